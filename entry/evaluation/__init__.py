"""Test scores of a trained run (rollouts, error budget, references) and their plots."""
