"""`python -m orchestrator run CONFIG.yaml [--name NAME] [--set k=v ...] [--result-json PATH]`;
`python -m orchestrator resume RUN [--result-json PATH]`;
`python -m orchestrator sweep SWEEP.yaml [--set k=v ...] [--json PATH]`;
`python -m orchestrator simulate CONFIG.yaml [--replicas 1,2,4,...] [--from-run RUN] [--plot PATH] [--json PATH]`."""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence

EXIT_BAD_INPUT = 2
EXIT_FAILED = 1


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="orchestrator", description="Elastic training of PyTorch models on Ray.")
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train a job described by a YAML config")
    run.add_argument("config", help="path to the job's YAML config")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                     help="override one config field (repeatable), e.g. --set optimizer.lr=0.1")
    run.add_argument("--name", metavar="NAME", help="name the run (run.name): its checkpoints go to "
                     "<checkpoint.storage>/NAME/, and the same command again after a crash goes on from the newest")
    run.add_argument("--result-json", metavar="PATH", help="write the result as JSON to PATH")
    run.add_argument("--no-progress", action="store_true", help="no progress display, only the final line")
    res = sub.add_parser("resume", help="go on with a run from its newest good checkpoint, in the same MLflow run")
    res.add_argument("run", help="the run's checkpoint directory (<checkpoint.storage>/<mlflow run id>, a path or "
                     "URI) or its MLflow run id")
    res.add_argument("--tracking-uri", help="the MLflow store to look a run id up in (default: MLflow's default)")
    res.add_argument("--result-json", metavar="PATH", help="write the result as JSON to PATH")
    res.add_argument("--no-progress", action="store_true", help="no progress display, only the final line")
    sw = sub.add_parser("sweep", help="a grid or random search over config keys with Ray Tune (docs/sweeps.md)")
    sw.add_argument("sweep", help="path to the sweep file (base config, search space, metric)")
    sw.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override one field of the base config for every trial (repeatable)")
    sw.add_argument("--json", metavar="PATH", help="write the sweep's result (best config, table) as JSON to PATH")
    sw.add_argument("--no-progress", action="store_true", help="no progress lines, only the best trial")
    sub.add_parser("config-reference", help="print the config reference (docs/config.md)")
    sim = sub.add_parser("simulate", help="predict steps/s and samples/s per mode up to thousands of replicas "
                         "(the cost model, docs/cost-model.md)")
    sim.add_argument("config", help="path to the job's YAML config (its model, batch, optimizer, shards)")
    sim.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                     help="override one config field (repeatable)")
    sim.add_argument("--replicas", default="1,2,4,8,16,64,256,1024", help="replica counts (default %(default)s)")
    sim.add_argument("--from-run", metavar="RUN_ID", help="take the step's compute (and, for allreduce, the "
                     "bandwidth) from a finished run's MLflow figures instead of a calibration here")
    sim.add_argument("--tracking-uri", help="the MLflow store the run is in (default: MLflow's default)")
    sim.add_argument("--bandwidth-gbps", type=float, help="model a link of this many Gbit/s (default: measured)")
    sim.add_argument("--latency-us", type=float, help="model a link with this latency per message (default: measured)")
    sim.add_argument("--cores", help="replicas the hosts run at full speed; beyond it compute and communication slow in proportion; "
                     "'here': this host's effective cores, measured by running one replica's calibration steps in "
                     "as many processes at once as it has CPUs (default: every replica has its own cores)")
    sim.add_argument("--shard-path", choices=("link", "here"), default="link",
                     help="the parameter shards' exchanges (downpour, easgd): 'link' costs them as the link's "
                     "messages; 'here' measures them with real shards on Ray (the one RAY_ADDRESS names, or a "
                     "local one started for it; about 10 s more) unless --from-run gives a downpour or easgd "
                     "run's own (default: %(default)s)")
    sim.add_argument("--straggler-p", type=float, default=0.0, help="chance a replica's step is slowed (default 0)")
    sim.add_argument("--straggler-factor", type=float, default=1.0, help="how much slower a slowed step is")
    sim.add_argument("--jitter", type=float, default=0.0, help="lognormal sigma of every step's compute")
    sim.add_argument("--persistent", action="store_true", help="the slowed replicas stay slow (a heterogeneous "
                     "cluster: a fraction straggler-p of the replicas is straggler-factor slower all the time)")
    sim.add_argument("--period", type=int, help="local SGD's and EASGD's period H (default: strategy.period for local SGD, strategy.tau "
                     "for EASGD)")
    sim.add_argument("--plot", default=None, metavar="PATH", help="where the plot goes (default ./simulate.png)")
    sim.add_argument("--json", metavar="PATH", help="write the calibration and the predictions as JSON")
    return p


def _guarded(work, doing: str, run: str):
    """(work(), None), or (None, the exit code) with one line on stderr: bad input found once
    connected to Ray (the cluster cannot hold the job; no actor started) 2, a failure 1, an
    interrupt 130."""
    from orchestrator.checks import one_line
    from orchestrator.errors import ConfigError, TrainingError

    try:
        return work(), None
    except ConfigError as exc:
        print(f"orchestrator: {one_line(exc)}", file=sys.stderr)
        return None, EXIT_BAD_INPUT
    except TrainingError as exc:
        print(f"orchestrator: {doing} failed: {exc}", file=sys.stderr)
        return None, EXIT_FAILED
    except KeyboardInterrupt:
        print(f"orchestrator: interrupted; {run} is marked KILLED", file=sys.stderr)
        return None, 130


def _writable(flag: str, *paths: str) -> None:
    """Every file the command will write under `flag` can be written (checked before anything runs):
    ConfigError naming the flag otherwise. Creates nothing."""
    from orchestrator.checks import writable_local_file
    from orchestrator.errors import ConfigError

    for path in paths:
        why = writable_local_file(path)
        if why:
            raise ConfigError(f"{flag}: cannot write {path} ({why})")


def _result_files(result_json: str) -> tuple[str, str]:
    """The files --result-json writes: the JSON, and training.png beside it."""
    from orchestrator.reporting.plots import PLOT_NAME

    return result_json, os.path.join(os.path.dirname(os.path.abspath(result_json)), PLOT_NAME)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    from orchestrator.config import JobConfig

    if args.command == "config-reference":
        from orchestrator.cli.config_docs import reference_markdown

        print(reference_markdown())
        return 0
    from orchestrator.checks import one_line
    from orchestrator.errors import ConfigError

    if args.command == "sweep":
        return _sweep(args)
    if args.command == "simulate":
        return _simulate(args)
    try:
        if args.result_json:
            _writable("--result-json", *_result_files(args.result_json))
        resume = None
        if args.command == "resume":
            from orchestrator.persistence.resume import find_checkpoint

            path, resume, skipped = find_checkpoint(args.run, args.tracking_uri)
            config = JobConfig.from_dict(resume["config"])
        else:
            overrides = list(args.overrides) + ([f"run.name={args.name}"] if args.name is not None else [])
            config = JobConfig.from_yaml(args.config, overrides)
        from orchestrator.trainer import ElasticTrainer

        trainer = ElasticTrainer(config, show_progress=not args.no_progress, resume=resume)
        if resume is not None:
            trainer.resumed_from, trainer.skipped = path, skipped
        trainer.check()  # bad input stops here, before Ray or MLflow start (fit() checks the cluster)
    except ConfigError as exc:
        print(f"orchestrator: {one_line(exc)}", file=sys.stderr)  # bad input: this one line is all stderr gets
        return EXIT_BAD_INPUT
    result, code = _guarded(trainer.fit, "training", "the MLflow run")
    if code is not None:
        return code
    if args.no_progress:  # no progress display and no summary from fit(): one final line
        print(result.final_line(config.headline_metric()), flush=True)
    if args.result_json:
        json_path, plot_path = _result_files(args.result_json)
        os.makedirs(os.path.dirname(plot_path), exist_ok=True)
        with open(json_path, "w", encoding="utf-8") as f:
            f.write(result.to_json())
        from orchestrator.reporting.plots import PLOT_NAME, training_plot

        try:  # the run's record is complete either way (training.png is in its MLflow run too)
            training_plot(result.events, plot_path)
        except Exception as exc:
            print(f"orchestrator: {PLOT_NAME} not drawn ({type(exc).__name__}: {exc})", file=sys.stderr)
    return 0


def _sweep(args: argparse.Namespace) -> int:
    """The sweep subcommand: bad input (the --json path included) exits 2 before Ray starts; 1 when no
    trial finished."""
    from orchestrator.checks import one_line
    from orchestrator.errors import ConfigError
    from orchestrator.sweep import load_sweep, run_sweep

    try:
        if args.json:
            _writable("--json", args.json)
        plan = load_sweep(args.sweep, args.overrides)
    except ConfigError as exc:
        print(f"orchestrator: {one_line(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    result, code = _guarded(lambda: run_sweep(plan, show_progress=not args.no_progress), "sweep",
                            "the sweep's MLflow run")
    if code is not None:
        return code
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(result.to_json())
    from orchestrator.sweep import comparison_markdown

    print(comparison_markdown(result.rows, result.metric), end="")
    print(f"best: {result.metric} {result.best_value:.4f} with {json.dumps(result.best_params)} "
          f"(trial {result.best_trial}, MLflow run {result.best_run_id}; parent run {result.parent_run_id} "
          f"at {result.tracking_uri})", flush=True)
    return 0


def _simulate(args: argparse.Namespace) -> int:
    """The simulate subcommand: bad input (the --plot and --json paths included) exits 2 before calibrating."""
    from orchestrator.checks import one_line
    from orchestrator.config import JobConfig
    from orchestrator.errors import ConfigError
    from orchestrator.cli import simulate as sim
    from orchestrator.cli.calibration import from_run
    from policies.decisions.cost_model import Stragglers

    path = args.plot or sim.PLOT_NAME
    try:
        _writable("--plot", path)
        if args.json:
            _writable("--json", args.json)
        config = JobConfig.from_yaml(args.config, args.overrides)
        replicas = sim.parse_replicas(args.replicas)
        try:
            stragglers = Stragglers(args.straggler_p, args.straggler_factor, args.jitter, args.persistent)
        except ValueError as exc:
            raise ConfigError(f"straggler options: {exc}") from None
        if args.cores is not None and args.cores != "here":
            try:
                args.cores = float(args.cores)
            except ValueError:
                raise ConfigError(f"--cores must be a number > 0 or 'here', got {args.cores!r}") from None
        for flag in ("bandwidth_gbps", "latency_us", "cores", "period"):
            value = getattr(args, flag)
            if flag == "cores" and value == "here":
                continue
            if value is not None and not value > 0:
                raise ConfigError(f"--{flag.replace('_', '-')} must be > 0, got {value}")
        run = from_run(args.from_run, args.tracking_uri) if args.from_run else None
        cal, preds = sim.simulate(config, replicas, stragglers, run, args.bandwidth_gbps, args.latency_us,
                                  args.cores, args.period, args.shard_path)
    except ConfigError as exc:
        print(f"orchestrator: {one_line(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(sim.render(preds, cal, stragglers))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    sim.plot(preds, path, f"{os.path.basename(args.config)}: predicted samples/s")
    print(f"plot: {path}")
    if args.json:
        sim.write_json(args.json, cal, preds, stragglers)
    return 0
