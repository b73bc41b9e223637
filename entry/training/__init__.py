"""Training a stage: building its models, the loop, checkpoints and resume, validation, the
runner that wraps a stage as a command, and the order stages run in."""
