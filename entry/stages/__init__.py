"""The stages, each defined once (`record.py`: what it reads, what its result depends on, when it
applies, its step, its probe, its build, its cache, its validation and its prediction at test
time), their builds and predictions (`<stage>.py`), what a build hands the loop (`parts.py`), the
blocks the builds share (`stage_build.py`), their step settings (`settings.py`) and the step
functions of the stages whose batches need completing first (`steps.py`). Above entry/data (the
builds read the cache), below entry/evaluation and entry/training, which read the record."""
