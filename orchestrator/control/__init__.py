"""The control plane: the controller's state machine, the run's contexts, and the state handlers."""
