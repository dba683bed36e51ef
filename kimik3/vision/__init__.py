"""Image input path of Kimi-K3: preprocessing (pixels, grids, token counts) and prompt helpers.

The MoonViT tower and projector that consume ``pixel_values``/``grid_thws`` live in
``kimik3/model/vision.py``.
"""
