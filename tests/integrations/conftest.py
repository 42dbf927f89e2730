"""transformers, accelerate, PEFT and TRL are in the ``test`` extra: these tests import them (a missing one is an
error of the set-up, never a skip)."""
