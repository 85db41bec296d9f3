"""PyTorch reference side of the tests: nemo-automodel's DeepSeek-V4.1 run in .venv-ref (see driver.py)."""
