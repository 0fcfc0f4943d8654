"""Verification commands and their measures: verify-equivalence (equivalence.py), verify-hf
(parity.py), the model smoke run (smoke.py) and analytic FLOPs of both paths (flops.py)."""
