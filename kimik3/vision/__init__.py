"""Image input path of Kimi-K3: preprocessing (pixels, grids, token counts).

The MoonViT tower and projector that consume ``pixel_values``/``grid_thws`` live in
``kimik3/model/vision.py``; the prompt's image segments are rendered by ``kimik3/chat/k3.py``.
"""
