"""Calibration of spec_min_p and block size for one artifact on one machine."""
