"""The training step a user would write, the same in every mode: which optimizer, the learning
rate at each step, gradient accumulation, mixed precision and gradient clipping.

Each mode's rule (policies/rules/<mode>.py) keeps its own communication; what it does with one
replica's batch goes through a `Recipe`:

    recipe.backward(model, task, x, y, before_last)   # micro-batches, autocast, loss scaling
    ... the mode's communication (allreduce: the summed gradient, divided by the rows) ...
    recipe.apply(optimizer, params)                   # unscale, clip, step (skipped on inf/NaN)

- Accumulation (`data.accumulate` = k): a step's batch holds k x `data.batch_size` rows and is
  taken as k micro-batches (near-equal row chunks), each forward and backward on its own, the
  gradients summed in place; one optimizer step (and in allreduce one reduction, in downpour
  one push) per batch. The gradient is that of the union of the micro-batches.
- Mixed precision (`model.precision`): forward and loss under `torch.autocast` (bf16 or fp16)
  on the replica's device; parameters, gradients, optimizer state and the reduction stay fp32.
  fp16 scales the loss (`torch.amp.GradScaler`): the scaled gradients are reduced, unscaled
  before clipping, and a step whose gradient holds inf/NaN is skipped and the scale lowered. In
  allreduce every replica holds the same summed gradient, so every replica skips alike.
- Clipping (`optimizer.clip_grad_norm`): the gradient's global 2-norm capped at the value
  (`torch.nn.utils.clip_grad_norm_`), after the reduction in allreduce (the same on every
  replica, equal to clipping in one process), on each step's own gradient elsewhere. The norm
  before clipping is measured every step either way (`grad_norm`).
- Schedules (`optimizer.schedule`): a factor on optimizer.lr by the optimizer step; see
  `Schedule`.

Actors import this module, never the driver package.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Union

import torch

from policies.rules.batches import rows as batch_rows, slice_rows
from policies.rules.outputs import run_model
from policies.rules.imports import NotImportable, import_function

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}

# torch.optim classes that update each element from its own gradient and state only: a shard
# applying one to its slice does exactly what it does to the whole vector
ELEMENTWISE = {"sgd", "adam", "adamw", "adagrad", "adadelta", "adamax", "asgd", "nadam", "radam", "rmsprop", "rprop"}
# classes that need the whole model (closures, factored or matrix-shaped state, sparse gradients)
WHOLE_MODEL = {"lbfgs": "needs a closure over the whole model's loss",
               "adafactor": "keeps factored (row and column) statistics of each matrix",
               "muon": "orthogonalizes each weight matrix as a whole",
               "sparseadam": "takes sparse gradients only"}


class RecipeError(ValueError):
    """A recipe setting that cannot be used (a one-line message naming the key)."""


def optimizer_class(name: str) -> type:
    """The optimizer class `name` names: a torch.optim class by its lower-case name (sgd,
    adamw, rmsprop, ...) or 'module:Class' (a torch.optim.Optimizer subclass)."""
    if ":" in name:
        try:
            cls = import_function(name)
        except NotImportable as exc:
            raise RecipeError(f"config error: optimizer.name: {exc}") from None
    else:
        classes = {n.lower(): getattr(torch.optim, n) for n in dir(torch.optim)
                   if isinstance(getattr(torch.optim, n), type) and issubclass(getattr(torch.optim, n), torch.optim.Optimizer)
                   and n != "Optimizer"}
        if name not in classes:
            raise RecipeError(f"config error: optimizer.name: unknown optimizer {name!r}; choose one of "
                              f"{', '.join(sorted(classes))} or 'module:Class'")
        cls = classes[name]
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise RecipeError(f"config error: optimizer.name: {name} is not a torch.optim.Optimizer subclass")
    return cls


def decay_groups(model: torch.nn.Module, no_decay: list[str]) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """(the parameters that decay, those that do not): a parameter takes no decay when one of
    `no_decay` (case-insensitive) is in its name or in its module's class name ("norm" catches
    LayerNorm and RMSNorm weights, whatever the attribute is called). Shared parameters once."""
    patterns = [p.lower() for p in no_decay]
    decay, plain, seen = [], [], set()
    for module_name, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            full = f"{module_name}.{name}".lower() if module_name else name.lower()
            owner = type(module).__name__.lower()
            (plain if any(pat in full or pat in owner for pat in patterns) else decay).append(p)
    return decay, plain


def make_optimizer(spec: dict[str, Any], params: Union[torch.nn.Module, Iterable[torch.nn.Parameter]]) -> torch.optim.Optimizer:
    """The optimizer `spec` describes (optimizer.*: name, lr, momentum, weight_decay, no_decay,
    kwargs) over `params` (a model, or its parameters). `momentum` goes to sgd only (other
    classes take theirs in kwargs); weight decay is the class's own (decoupled for AdamW), given
    to every class that takes one (0 means none, also for AdamW, whose own default is 0.01).
    With `no_decay` (a model given): two parameter groups, the matching parameters' without
    decay (decay_groups)."""
    import inspect

    name = spec["name"]
    cls = optimizer_class(name)
    kwargs = dict(spec.get("kwargs") or {})
    kwargs.setdefault("lr", spec["lr"])
    if "weight_decay" in inspect.signature(cls.__init__).parameters:
        kwargs.setdefault("weight_decay", spec.get("weight_decay") or 0.0)
    if name == "sgd":
        kwargs.setdefault("momentum", spec.get("momentum", 0.0))
    for key in ("betas",):  # YAML gives lists; torch's check wants tuples
        if isinstance(kwargs.get(key), list):
            kwargs[key] = tuple(kwargs[key])
    no_decay = list(spec.get("no_decay") or [])
    if no_decay and not isinstance(params, torch.nn.Module):
        raise RecipeError("config error: optimizer.no_decay: this optimizer steps parameters without their names "
                          "(a shard's flat slice); no_decay needs the model's")
    groups: Any = list(params.parameters()) if isinstance(params, torch.nn.Module) else list(params)
    if no_decay:
        decay, plain = decay_groups(params, no_decay)
        groups = [{"params": decay}, {"params": plain, "weight_decay": 0.0}]
    try:
        return cls(groups, **kwargs)
    except (TypeError, ValueError) as exc:
        raise RecipeError(f"config error: optimizer: {name}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())}) "
                          f"failed ({type(exc).__name__}: {exc})") from None


def shardable(name: str) -> Optional[str]:
    """Why a shard cannot apply optimizer `name` to its slice (None: it can)."""
    return WHOLE_MODEL.get(name.lower())


# ---- learning-rate schedules ----------------------------------------------------------------
SCHEDULES = ("constant", "linear", "cosine", "step", "exponential")


class Schedule:
    """A factor on optimizer.lr for optimizer step t of a run planned for `total` steps (the
    clock every mode shares: each replica's own optimizer steps, which advance by one per
    global batch of rows in every mode; a resize's linear-scaling ramp multiplies it).

    - `warmup` W steps (a fraction of `total` when < 1): the factor rises linearly to 1 at
      step W: (t + 1) / W.
    - then `name`, over u = t - W of U = total - W steps, from 1 down to `min_factor` (m):
      constant 1; linear 1 - (1 - m) u / U; cosine m + (1 - m) (1 + cos(pi u / U)) / 2;
      step gamma^floor(u / step_size); exponential gamma^u;
      any torch.optim.lr_scheduler class by name (kwargs beside it), stepped u times on an
      optimizer at lr 1; 'module:function' called as function(u, U).
      After the named decay the factor never goes below m (nor past step U: it stays at m).
    """

    def __init__(self, spec: Optional[dict[str, Any]], total: int) -> None:
        spec = dict(spec or {"name": "constant"})
        self.name = spec.get("name", "constant")
        self.total = max(1, int(total))
        w = float(spec.get("warmup") or 0)
        self.warmup = int(round(w * self.total)) if 0 < w < 1 else int(w)
        self.min_factor = float(spec.get("min_factor") or 0.0)
        self.kwargs = dict(spec.get("kwargs") or {})
        self._fn: Optional[Callable[[int, int], float]] = None
        self._torch: Optional[tuple[Any, Any, int]] = None  # (optimizer, scheduler, steps taken) for torch classes
        if ":" in self.name:
            try:
                self._fn = import_function(self.name)
            except NotImportable as exc:
                raise RecipeError(f"config error: optimizer.schedule.name: {exc}") from None
        elif self.name not in SCHEDULES:
            self._torch_class()  # raises for an unknown name

    def _torch_class(self) -> type:
        from torch.optim import lr_scheduler

        classes = {n.lower(): getattr(lr_scheduler, n) for n in dir(lr_scheduler)
                   if isinstance(getattr(lr_scheduler, n), type) and issubclass(getattr(lr_scheduler, n), lr_scheduler.LRScheduler)
                   and n not in ("LRScheduler", "_LRScheduler", "ReduceLROnPlateau", "SequentialLR", "ChainedScheduler")}
        key = self.name.lower()
        if key not in classes:
            raise RecipeError(f"config error: optimizer.schedule.name: unknown schedule {self.name!r}; choose one of "
                              f"{', '.join(SCHEDULES)}, a torch.optim.lr_scheduler class ({', '.join(sorted(classes))}) "
                              "or 'module:function'")
        return classes[key]

    def factor(self, t: int) -> float:
        t = max(0, int(t))
        if t < self.warmup:
            return (t + 1) / self.warmup
        u, span = t - self.warmup, max(1, self.total - self.warmup)
        m = self.min_factor
        if self.name == "constant":
            return 1.0
        if self.name == "linear":
            return max(m, 1.0 - (1.0 - m) * min(u, span) / span)
        if self.name == "cosine":
            return m + (1.0 - m) * (1.0 + math.cos(math.pi * min(u, span) / span)) / 2.0
        if self.name == "step":
            return max(m, float(self.kwargs.get("gamma", 0.1)) ** (min(u, span) // int(self.kwargs.get("step_size", max(1, span // 3)))))
        if self.name == "exponential":
            return max(m, float(self.kwargs.get("gamma", 0.999)) ** min(u, span))
        if self._fn is not None:
            return max(m, float(self._fn(min(u, span), span)))
        return max(m, self._torch_factor(min(u, span)))

    def _torch_factor(self, u: int) -> float:
        """A torch.optim.lr_scheduler class's rate at step u (lr 1), replayed forward from its
        last position (from 0 again when asked for an earlier step: a resume, a replacement)."""
        if self._torch is None or self._torch[2] > u:
            opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
            try:
                sched = self._torch_class()(opt, **self.kwargs)
            except (TypeError, ValueError) as exc:
                raise RecipeError(f"config error: optimizer.schedule: {self.name}(**kwargs) failed "
                                  f"({type(exc).__name__}: {exc})") from None
            self._torch = (opt, sched, 0)
        opt, sched, at = self._torch
        import warnings

        with warnings.catch_warnings():  # stepping a scheduler with no optimizer step between: intended here
            warnings.simplefilter("ignore")
            while at < u:
                sched.step()
                at += 1
        self._torch = (opt, sched, at)
        return float(opt.param_groups[0]["lr"])


def planned_steps(train_rows: int, batch_size: int, accumulate: int, replicas: int, epochs: int,
                  max_steps: Optional[int] = None) -> int:
    """The optimizer steps a run plans (each replica's: one per global batch of rows):
    epochs x ceil(train rows / (batch_size x accumulate x replicas)), or stop.max_steps when
    that comes first."""
    per_epoch = math.ceil(train_rows / max(1, batch_size * accumulate * replicas))
    return max(1, min(epochs * per_epoch, max_steps or epochs * per_epoch))


# ---- the step -------------------------------------------------------------------------------
@dataclass
class StepFacts:
    """What a step's recipe measured: the gradient's norm before clipping (None: not measured),
    and whether the optimizer step was applied (False: fp16 found inf/NaN and skipped it)."""

    grad_norm: Optional[float] = None
    applied: bool = True


class Recipe:
    """One replica's step recipe (see the module's docstring). `device`: the replica's."""

    def __init__(self, accumulate: int = 1, precision: str = "fp32", clip: Optional[float] = None,
                 device: Optional[torch.device] = None) -> None:
        if precision not in PRECISIONS:
            raise RecipeError(f"config error: model.precision: {precision!r}; choose one of {', '.join(PRECISIONS)}")
        self.accumulate = max(1, int(accumulate))
        self.precision = precision
        self.clip = clip
        self.device_type = (device or torch.device("cpu")).type
        self.scaler = torch.amp.GradScaler(self.device_type) if precision == "fp16" else None
        self.skipped = 0  # steps skipped: fp16's for inf/NaN gradients, and non-finite losses on probation
        self.skip_nonfinite = False  # a switch on probation (set by the replica each epoch): see `finite`
        self.last = StepFacts()

    @classmethod
    def from_config(cls, cfg: dict[str, Any], device: Optional[torch.device] = None) -> "Recipe":
        return cls(int(cfg["data"].get("accumulate", 1)), cfg["model"].get("precision", "fp32"),
                   cfg["optimizer"].get("clip_grad_norm"), device)

    def finite(self, loss: float) -> bool:
        """Whether the step with this loss may be applied. A non-finite loss raises
        FloatingPointError (the replica reports the run diverged and it ends), except while a
        switch is on probation (`skip_nonfinite`): then the step is skipped, not applied and
        counted in `skipped`, and the switch's guard rolls it back at the epoch's end (its
        evaluated loss risen, or not finite)."""
        if math.isfinite(loss):
            return True
        if not self.skip_nonfinite:
            raise FloatingPointError(f"the loss is {loss}")
        self.skipped += 1
        self.last = StepFacts(None, False)  # no gradient norm to report for it
        return False

    def autocast(self):
        dtype = PRECISIONS[self.precision]
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=dtype)

    def micro_batches(self, x: Any, y: Any) -> list[tuple[Any, Any, int]]:
        """The batch as `accumulate` near-equal row chunks (fewer when it has fewer rows)."""
        n = batch_rows(y)
        k = min(self.accumulate, n)
        if k <= 1:
            return [(x, y, n)]
        edges = [round(i * n / k) for i in range(k + 1)]
        return [(slice_rows(x, lo, hi), slice_rows(y, lo, hi), hi - lo) for lo, hi in zip(edges, edges[1:]) if hi > lo]

    def backward(self, model: torch.nn.Module, task: Any, x: Any, y: Any, summed: bool = False,
                 before_last: Optional[Callable[[torch.Tensor], None]] = None) -> float:
        """Forward and backward over the batch's micro-batches, gradients summed into `.grad`.
        The gradient is of the batch's mean loss, or with `summed` of its summed loss (mean x
        rows: allreduce divides by the step's rows across replicas). `before_last(loss)` is
        called with the batch's (detached, unscaled) loss, mean or summed, before the last
        micro-batch's backward (allreduce: the first bucket may leave during it). Returns the
        batch's mean loss (NaN/inf as computed: the caller checks it)."""
        parts = self.micro_batches(x, y)
        n = sum(p[2] for p in parts)
        total = None
        for i, (xm, ym, m) in enumerate(parts):
            with self.autocast():
                loss = task.loss(run_model(model, task, xm, ym), ym)
            weight = m if summed else m / n
            part = loss.float() * weight
            total = part.detach() if total is None else total + part.detach()
            if i == len(parts) - 1 and before_last is not None:
                before_last(total)
            (self.scaler.scale(part) if self.scaler is not None else part).backward()
        return float(total) / (n if summed else 1)

    def apply(self, optimizer: torch.optim.Optimizer, params: Optional[list[torch.nn.Parameter]] = None,
              norm: Optional[float] = None) -> StepFacts:
        """The optimizer step on the gradients in `.grad` (summed, reduced and divided as the
        mode does): unscaled (fp16), the norm measured and clipped, then stepped (fp16: skipped
        when a gradient is inf/NaN, and the scale lowered). `norm`: the gradient's norm when the
        mode measured it already (allreduce's buckets), used unless fp16 or clipping needs it
        recomputed."""
        params = params if params is not None else [p for g in optimizer.param_groups for p in g["params"]]
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
            norm = None  # the measured one was of the scaled gradient
        if self.clip:
            norm_value = float(torch.nn.utils.clip_grad_norm_(params, self.clip, foreach=True))
        elif norm is not None:
            norm_value = float(norm)
        else:
            grads = [p.grad for p in params if p.grad is not None]
            norm_value = float(torch.nn.utils.get_total_norm(grads, foreach=True)) if grads else 0.0
        applied = True
        if self.scaler is not None:
            scale = self.scaler.get_scale()
            self.scaler.step(optimizer)
            self.scaler.update()
            applied = math.isfinite(norm_value) and self.scaler.get_scale() >= scale
            self.skipped += not applied
        else:
            optimizer.step()
        self.last = StepFacts(norm_value, applied)
        return self.last

    def state_dict(self) -> dict[str, Any]:
        return {"scaler": self.scaler.state_dict() if self.scaler is not None else None, "skipped": self.skipped}

    def load_state_dict(self, state: Optional[dict[str, Any]]) -> None:
        if not state:
            return
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
