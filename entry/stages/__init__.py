"""The stages, each defined once (`record.py`: what it reads, what its result depends on, when it
applies, its step and its probe), and the step functions of the stages whose batches need
completing first (`steps.py`). Below entry/data, entry/evaluation and entry/training, which all
read the record."""
