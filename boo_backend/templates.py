"""Render the kernel templates under kernels/ (Jinja2). A leaf: imports only config.

Undefined template variables are errors. A template that fails to render, or renders MLIR
that does not parse, is reported with its numbered lines.
"""

from __future__ import annotations

import functools
import importlib.resources

import jinja2

from .config import BooError


@functools.cache
def _environment() -> jinja2.Environment:
    root = importlib.resources.files("boo_backend.kernels")
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(root)),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )


def numbered(text: str, around: int | None = None, context: int = 8) -> str:
    lines = text.splitlines()
    lo, hi = (0, len(lines)) if around is None else (max(0, around - 1 - context), around + context)
    return "\n".join(f"{i + 1:5d}{'>' if i + 1 == around else ' '} {lines[i]}" for i in range(lo, min(hi, len(lines))))


def template_path(name: str):
    return importlib.resources.files("boo_backend.kernels") / name


def exists(name: str) -> bool:
    return template_path(name).is_file()


def render(name: str, **variables) -> str:
    """Render kernels/<name> with `variables`."""
    try:
        return _environment().get_template(name).render(**variables)
    except jinja2.TemplateSyntaxError as e:
        source = e.source or ""
        raise BooError(f"kernel template {e.filename or name} line {e.lineno}: {e.message}\n{numbered(source, e.lineno)}") from e
    except jinja2.UndefinedError as e:
        raise BooError(f"kernel template {name}: {e.message}; variables given: {sorted(variables)}") from e
    except jinja2.TemplateNotFound as e:
        raise BooError(f"kernel template {name} not found under kernels/") from e
