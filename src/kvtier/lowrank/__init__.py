"""Calibration steps that run the model to prepare what a part below the engine needs.

- `lowrank_fit.py`: one prefill of a calibration text -> a low-rank KV basis (PCA)
- `lowrank.py`: the bases a compression pipeline names, from the disk cache or fitted now,
  handed to the press (`with_fitted_bases`; every command calls it before the engine)

(`kvtier calibrate`, the hardware-profile fit of the simulator, lives in `kvtier.sim`.)
"""
