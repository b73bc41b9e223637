"""The models of a run: built from the config through the model registry (`build`), their
registry descriptions beside exported weights (`files`), and exported weights loaded into them
(`weights`). Below entry/data, entry/evaluation and entry/training, which all use them."""
