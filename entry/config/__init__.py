"""The experiment config: its typed schema, loading YAML with `--set` overrides, and the command
line every command shares."""
