"""Gradient math shared by every parallel path.

- main_grad.py: where a parameter's gradient lives (``main_grad``, ZeRO shards), and summing a
  few gradients over a group in one collective;
- norm.py: the global gradient norm over the whole rank grid, clipping and overflow detection;
- weight_grad.py: the zero-bubble B/W split, weight gradients deferred to the W action.
"""
