"""MLIR templates for boo's composite kernels (Jinja2). Data, not code: installed as the
package `boo_backend.kernels`; `boo_backend/kernels_render.py` renders them."""
