"""Argument roles of an op definition: what each argument is, checked, stored in a case file, generated.

An op definition (ops/defs/*.py) lists its arguments as roles: `Tensor` (activations, weights,
per-channel vectors, int8 codes, scales), `Float`, `Int`, `Choice`, `Ints`, `DType`. From that one list
everything that touches arguments is derived: the Python entry point's signature and defaults, the
custom op's schema, the validation of every call (errors that name the argument, what was seen
and what was expected), a case file's input fields (written by the recorder, read and checked
by the case loader) and the inputs a case regenerates from its seed.

Shapes are patterns over named dims: "*R D" is any number of leading dims (bound to R) then D;
"N K" is exactly two dims; a name already bound by an earlier argument must match. A `flat`
tensor (a per-channel vector) may carry singleton dims, e.g. a (1, D, 1, 1) weight.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
DTYPE_NAMES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
               "int8": torch.int8, "int32": torch.int32, "int64": torch.int64, "float64": torch.float64,
               "bool": torch.bool}  # bool: attention masks
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # a Parameter is a plain tensor here
_EMPTY = object()


def dtype_name(dtype) -> str:
    """`torch.bfloat16` -> "bfloat16": the one spelling of a dtype in messages, reports and case files."""
    return str(dtype).replace("torch.", "")


def _names(dtypes) -> str:
    names = [dtype_name(d) for d in dtypes]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


class ArgTypeError(TypeError):
    """A call refused for an argument's type or dtype; `arg` names it, `aspect` what about it."""

    def __init__(self, arg: str, message: str, aspect: str = "dtype"):
        super().__init__(f"{arg}: {message}")
        self.arg, self.aspect = arg, aspect


class ArgValueError(ValueError):
    """A call refused for an argument's shape or value; `arg` names it, `aspect` what about it."""

    def __init__(self, arg: str, message: str, aspect: str = "shape"):
        super().__init__(f"{arg}: {message}")
        self.arg, self.aspect = arg, aspect


@dataclass
class Context:
    """What the checks of one call have established so far: named dims and who bound them, the device."""

    dims: dict = field(default_factory=dict)
    binder: dict = field(default_factory=dict)
    device: torch.device | None = None
    first: str = ""
    values: dict = field(default_factory=dict)
    min_dims: dict = field(default_factory=dict)  # symbol -> smallest size allowed, checked when bound


class Arg:
    """Base of the roles. `case` is the argument's name in case files (older files used other names)."""

    annotation = object
    optional = False

    def __init__(self, name: str, *, default=_EMPTY, kw_only: bool = False, case: str | None = None, doc: str = ""):
        self.name, self.default, self.kw_only, self.doc = name, default, kw_only, doc
        self.case = case or name

    @property
    def required(self) -> bool:
        return self.default is _EMPTY

    def check(self, value, ctx: Context) -> None:
        raise NotImplementedError

    # case files ------------------------------------------------------------------------------------
    def to_case(self, value):
        """The case-file entry for a recorded value ({"value": v}), None to leave it out."""
        return {"value": value}

    def from_case(self, entry, max_elements):
        """The value a case-file entry stands for (checked by `check` afterwards)."""
        if not isinstance(entry, dict) or "value" not in entry:
            raise ArgValueError(self.name, f"got {entry!r}; expected {{\"value\": ...}}", "")
        return entry["value"]

    def generate(self, value, gen: torch.Generator):
        return value


class Tensor(Arg):
    """A tensor argument.

    dtypes: the dtypes accepted, or None with `like=` another tensor argument whose dtype it must have
      (`floats=True` instead: any float dtype, as HF accepts an fp32 weight with bf16 activations).
    shape: a pattern, e.g. "*R D" (activations), "D" (a per-channel vector), "N K", "*R" (per-row scales).
    flat: singleton dims allowed around the pattern's dims (per-channel weights such as (1, D, 1, 1)).
    gen: how a case regenerates it from the seed: "normal", "weight" (1 + 0.1 N), "smooth"
      (0.5 + U), "small" (0.1 N), "int8" (codes), "scale" (positive fp32), "angle" (cos/sin-like), or
      a function (shape, generator) -> float32 tensor.
    """

    annotation = torch.Tensor

    def __init__(self, name: str, shape: str, dtypes=FLOAT_DTYPES, *, like: str | None = None, floats: bool = False,
                 optional: bool = False, flat: bool = False, gen="normal", **kw):
        if optional:
            kw.setdefault("default", None)
        super().__init__(name, **kw)
        self.pattern = shape.split()
        self.dtypes, self.like, self.floats, self.optional, self.flat, self.gen = dtypes, like, floats, optional, \
            flat, gen
        if optional:
            self.annotation = torch.Tensor | None

    def _expected(self, ctx: Context) -> str:
        parts = []
        for p in self.pattern:
            if p.startswith("*"):
                parts.append("..." if p[1:] not in ctx.dims else ", ".join(map(str, ctx.dims[p[1:]])) or None)
            elif p.isdigit():
                parts.append(p)
            else:
                parts.append(str(ctx.dims.get(p, p)))
        parts = [p for p in parts if p]
        return "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"

    def check(self, t, ctx: Context) -> None:
        name = self.name
        if t is None:
            if self.optional:
                return
            raise ArgTypeError(name, "got None; expected a torch.Tensor", "value")
        if not isinstance(t, torch.Tensor):
            raise ArgTypeError(name, f"expected a torch.Tensor{' or None' if self.optional else ''}, got "
                                     f"{type(t).__name__}", "value")
        if self.like is not None and self.like in ctx.values and ctx.values[self.like] is not None:
            other = ctx.values[self.like].dtype
            if t.dtype != other:
                raise ArgTypeError(name, f"dtype {dtype_name(t.dtype)} must match {self.like}'s dtype "
                                         f"{dtype_name(other)}")
        elif self.floats:
            if not t.is_floating_point():
                raise ArgTypeError(name, f"dtype {dtype_name(t.dtype)} not supported; expected a floating dtype")
        elif self.dtypes is not None and t.dtype not in self.dtypes:
            raise ArgTypeError(name, f"dtype {dtype_name(t.dtype)} not supported; expected {_names(self.dtypes)}")
        self._match(t.shape, ctx)
        if ctx.device is None:
            ctx.device, ctx.first = t.device, name
        elif t.device != ctx.device:
            raise ArgValueError(name, f"on device {t.device}, expected {ctx.first}'s device {ctx.device}", "device")

    def _match(self, shape, ctx: Context) -> None:
        shape = tuple(shape)
        pattern = self.pattern
        if self.flat:
            wanted = [p for p in pattern if not p.startswith("*")]
            dims = [s for s in shape if s != 1]
            if len(wanted) == 1 and not wanted[0].isdigit() and wanted[0] not in ctx.dims and len(dims) <= 1:
                ctx.dims[wanted[0]], ctx.binder[wanted[0]] = math.prod(shape), self.name
                return
            sizes = [ctx.dims.get(p) if not p.isdigit() else int(p) for p in wanted]
            if len(dims) <= len(wanted) and math.prod(shape) == math.prod(s for s in sizes if s is not None) \
                    and None not in sizes:
                return
            raise ArgValueError(self.name, f"shape {shape} does not match {self._origin(wanted, ctx)}; expected "
                                           f"{self._expected(ctx)}")
        fixed = [p for p in pattern if not p.startswith("*")]
        star = next((p[1:] for p in pattern if p.startswith("*")), None)
        if len(shape) < len(fixed) or (star is None and len(shape) != len(fixed)):
            if not shape:
                raise ArgValueError(self.name, f"rank-0 tensor (shape ()); expected shape {self._expected(ctx)}"
                                               f" with rank >= {len(fixed)}")
            raise ArgValueError(self.name, f"shape {shape} has rank {len(shape)}; expected {self._expected(ctx)}")
        n_star = len(shape) - len(fixed)
        i = 0
        for p in pattern:
            if p.startswith("*"):
                got, i = shape[i:i + n_star], i + n_star
                self._bind(p[1:], got, shape, ctx)
                continue
            got, i = shape[i], i + 1
            if p.isdigit():
                if got != int(p):
                    raise ArgValueError(self.name, f"shape {shape}; expected {self._expected(ctx)}")
            else:
                self._bind(p, got, shape, ctx)

    def _bind(self, symbol, got, shape, ctx: Context) -> None:
        if symbol not in ctx.dims:
            low = ctx.min_dims.get(symbol)
            if low is not None and got < low:
                raise ArgValueError(self.name, f"{symbol}={got} (shape {shape}); expected {symbol} >= {low}")
            ctx.dims[symbol], ctx.binder[symbol] = got, self.name
        elif ctx.dims[symbol] != got:
            raise ArgValueError(self.name, f"shape {shape} does not match {ctx.binder[symbol]}; expected "
                                           f"{self._expected(ctx)}")

    def _origin(self, symbols, ctx: Context) -> str:
        binders = sorted({ctx.binder[s] for s in symbols if s in ctx.binder})
        return (binders[0] + "'s " + "/".join(s for s in symbols if s in ctx.binder)) if binders else "the op"

    # case files ------------------------------------------------------------------------------------
    def to_case(self, t):
        return None if t is None else {"shape": list(t.shape), "dtype": dtype_name(t.dtype)}

    def from_case(self, entry, max_elements):
        """A meta tensor of the entry's shape and dtype (checked like a real argument afterwards)."""
        if entry is None:
            return None
        if not isinstance(entry, dict) or "shape" not in entry or "dtype" not in entry:
            raise ArgValueError(self.name, "expected {\"shape\": [...], \"dtype\": ...}", "")
        shape, dtype = entry["shape"], entry["dtype"]
        if not isinstance(shape, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                                   for s in shape):
            raise ArgValueError(self.name, f"got {shape!r}; expected a list of non-negative ints", "shape")
        if not isinstance(dtype, str) or dtype not in DTYPE_NAMES:
            raise ArgTypeError(self.name, f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPE_NAMES)}")
        n = math.prod(shape)
        if max_elements is not None and n > max_elements:
            raise ArgValueError(self.name, f"{shape} has {n:,} elements, above the cap of {max_elements:,} (raise it "
                                           f"with --max-elements)", "shape")
        return torch.empty(shape, dtype=DTYPE_NAMES[dtype], device="meta")

    def generate(self, meta, gen: torch.Generator):
        """A real tensor for a case's meta tensor, from the case's generator (same seed, same values)."""
        if meta is None:
            return None
        shape, dtype = meta.shape, meta.dtype
        if callable(self.gen):
            return self.gen(shape, gen).to(dtype)
        if self.gen == "int8":
            return torch.randint(-128, 128, shape, generator=gen, dtype=torch.int8)
        x = torch.randn(shape, generator=gen, dtype=torch.float32)
        if self.gen == "weight":
            x = 1 + 0.1 * x
        elif self.gen == "smooth":
            x = 0.5 + torch.rand(shape, generator=gen)
        elif self.gen == "small":
            x = 0.1 * x
        elif self.gen == "scale":
            x = 1e-3 * (0.5 + torch.rand(shape, generator=gen))
        elif self.gen == "angle":
            x = torch.cos(3 * x)
        return x.to(dtype)


class Float(Arg):
    """A float scalar with a range (`low`, `low_open`: the bound excluded)."""

    annotation = float

    def __init__(self, name: str, *, low: float = -math.inf, low_open: bool = False, **kw):
        super().__init__(name, **kw)
        self.low, self.low_open = low, low_open

    def check(self, value, ctx: Context) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ArgTypeError(self.name, f"expected a float, got {type(value).__name__}", "value")
        expected = f"a finite {self.name} {'>' if self.low_open else '>='} {self.low:g}"
        try:
            v = float(value)
        except OverflowError:
            raise ArgValueError(self.name, f"got an integer with {len(str(abs(value)))} digits; expected {expected}",
                                "value") from None
        if not math.isfinite(v) or v < self.low or (self.low_open and v == self.low):
            raise ArgValueError(self.name, f"got {value}; expected {expected}", "value")


class Int(Arg):
    """An integer scalar within [low, high] (a dimension index such as rope's unsqueeze_dim)."""

    annotation = int

    def __init__(self, name: str, *, low: int, high: int, **kw):
        super().__init__(name, **kw)
        self.low, self.high = low, high

    def check(self, value, ctx: Context) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ArgTypeError(self.name, f"expected an int, got {type(value).__name__}", "value")
        if not self.low <= value <= self.high:
            raise ArgValueError(self.name, f"got {value}; expected an int in [{self.low}, {self.high}]", "value")


class Choice(Arg):
    """One of a fixed set of strings (cast_mode, dst_type)."""

    annotation = str

    def __init__(self, name: str, choices, **kw):
        super().__init__(name, **kw)
        self.choices = tuple(choices)

    def check(self, value, ctx: Context) -> None:
        if value not in self.choices:
            raise ArgValueError(self.name, f"got {value!r}; expected one of {', '.join(map(repr, self.choices))}",
                                "value")


class Bool(Arg):
    """A flag (dequant_swiglu_quant's activate_left)."""

    annotation = bool

    def check(self, value, ctx: Context) -> None:
        if not isinstance(value, bool):
            raise ArgTypeError(self.name, f"expected True or False, got {type(value).__name__}", "value")


class Ints(Arg):
    """A list of non-negative ints (e.g. MRoPE's sections)."""

    annotation = list[int]

    def check(self, value, ctx: Context) -> None:
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                                           for v in value):
            raise ArgValueError(self.name, f"got {value!r}; expected a list of non-negative ints", "value")

    def to_case(self, value):
        return {"value": list(value)}


class DType(Arg):
    """A torch dtype (an output dtype); written to case files by name."""

    annotation = torch.dtype

    def __init__(self, name: str, dtypes=FLOAT_DTYPES, **kw):
        super().__init__(name, **kw)
        self.dtypes = dtypes

    def check(self, value, ctx: Context) -> None:
        if value not in self.dtypes:
            raise ArgTypeError(self.name, f"got {value}; expected {_names(self.dtypes)}", "value")

    def to_case(self, value):
        return {"value": dtype_name(value)}

    def from_case(self, entry, max_elements):
        name = super().from_case(entry, max_elements)
        if name not in DTYPE_NAMES:
            raise ArgTypeError(self.name, f"unknown dtype {name!r}; expected one of {_names(self.dtypes)}", "value")
        return DTYPE_NAMES[name]


@dataclass(frozen=True)
class Output:
    """One output of an op. kind: "float" (SPEC 5's relative rule), "codes" (quantised integers: at most
    one code apart in 0.1% of elements), "scale" (relative error <= 1e-5), "rotation" and "mixture" (SPEC 5's
    rule relative to the head vector's rms near zero, for rotations and attention outputs: precision.py), "exact" (integer sums: equal). `present_if`: the output
    exists only when that argument is given (else the entry point returns None for it)."""

    name: str
    kind: str = "float"
    case: str | None = None
    present_if: str | None = None

    @property
    def case_name(self) -> str:
        return self.case or self.name
