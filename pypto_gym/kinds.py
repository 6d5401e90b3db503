"""Site kinds: which part of a model a module is in, and the kind a site or a linear is filed under.

A kind is "<part>.<what>" ("text.norm", "vision.attention", "text.o_proj"): what `sites=` and `float_linears=`
globs match, what the report's rows and the case files say. The part is read from the module's path, for either
transformers layout (`model.visual.blocks.0`, `model.vision_tower...`): "vision" under a vision tower, else "text".
"""
VISION_PARTS = {"visual", "vision", "vision_tower", "vision_model", "vision_encoder"}  # a vision tower's names


def part(path: str) -> str:
    """`vision` or `text`: which tower a module path is in."""
    return "vision" if VISION_PARTS & set(path.split(".")) else "text"


def kind(path: str, what: str) -> str:
    """The kind of a site or linear at `path`: its part and what it is ("vision.attention")."""
    return f"{part(path)}.{what}"
