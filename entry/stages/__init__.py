"""The stages, each defined once: its record (`SPEC`, a `StageSpec` of `spec.py`: what it reads,
what its result depends on, when it applies, its step, its probe, its build, its cache, its
validation and its prediction at test time) in `<stage>.py` beside its build, step settings,
probe and prediction; `record.py` collects the records in pipeline order (`STAGES`). Also what a
build hands the loop (`parts.py`) and the blocks the builds share (`stage_build.py`). Above
entry/data (the builds read the cache), below entry/evaluation and entry/training, which read the
record."""
