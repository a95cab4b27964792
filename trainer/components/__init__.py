"""The training loop's components (base.py: the hooks the loop calls, and `Loop`, what they
see of it): model selection, continuous training, publishing and calibration."""
