"""AIPerf scenarios against ouro_fast: configs, the validating wrapper (run.py) and its manifest."""
