"""Non-tensor arguments of a graphed call are frozen into the graph: each call must pass the same.

A graph replays kernels; whatever its Python code did with a non-tensor argument (read a flag,
append to a cache object) happened once, at capture. So a replay is only correct when every
non-tensor argument equals the captured one. The usual way to break that is an object built anew
on every call, whose equality is identity: HF transformers models build a new KV cache
(``DynamicCache``) on every forward while ``use_cache`` is on, their default, and hand it to every
decoder layer. The messages here name the argument, the object's type, why it changed, and the
fix, so that this is refused once, before capture, instead of at the first replay.
"""

from __future__ import annotations


def _type_name(x) -> str:
    return f"{type(x).__module__}.{type(x).__qualname__}"


def _fix(x) -> str:
    if type(x).__module__.startswith("transformers") and "Cache" in type(x).__name__:
        return (
            "This is an HF KV cache: the model builds a new one on every forward while use_cache is on "
            "(HF's default), and training needs none. Set model.config.use_cache = False before building the step."
        )
    return (
        "Pass it as a tensor (copied in at every call), pass the very same object on every call, or "
        "leave this module eager."
    )


def new_object_each_call(where: str, name: str, first, second) -> str:
    """Two calls before capture passed different objects: refused before capture."""
    kind = "a new object on each call" if type(first) is type(second) else f"then a {_type_name(second)}"
    return (
        f"{where}: argument {name} is a {_type_name(first)}, {kind} (two example calls passed different "
        f"values, {first!r} and {second!r}). Non-tensor arguments are frozen into a CUDA graph at capture, "
        f"so no later call could replay. {_fix(first)}"
    )


def changed_since_capture(where: str, name: str, live, frozen) -> str:
    """A replay got a different non-tensor argument than the capture did."""
    why = ""
    if type(live) is type(frozen) and type(frozen).__eq__ is object.__eq__:
        why = (f" Both are {_type_name(frozen)} objects, which compare by identity: an object built anew on "
               "every call never matches the captured one.")
    return (
        f"{where}: argument {name} is {live!r} but was {frozen!r} at capture.{why} Non-tensor arguments are "
        f"frozen into the graph at capture. {_fix(frozen)} Otherwise capture again with the new value."
    )


def same(a, b) -> bool:
    """Whether a replay with ``a`` may stand in for a capture with ``b``."""
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:  # an __eq__ that returns a tensor or raises: not provably the same
        return False
