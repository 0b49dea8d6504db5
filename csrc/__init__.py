"""igemm's device headers (shipped inside the wheel as ``igemm.csrc``; found with importlib.resources)."""
