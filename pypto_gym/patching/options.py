"""PatchConfig: every option of one patch, validated once in `patch_model` and read by every site.

None means the process default, read from the environment by the one parser of config.py:
backend $PYPTO_GYM_BACKEND (else "auto"), sites $PYPTO_GYM_SITES (else every site), fuse_residual
$PYPTO_GYM_FUSE_RESIDUAL (else on), strict the process-wide switch ($PYPTO_GYM_STRICT, set_strict).
Quantisation modes are registered by the packages that provide them (pypto_gym.quant registers
"w8a8"), so this package needs no import of theirs.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from .. import config
from ..ops import registry
from ..ops.defs.rms_norm import CAST_MODES

QUANT_MODES: dict = {}  # name -> installer(model, state) returning an object with uninstall() and to_json()


def register_quant_mode(name: str, installer) -> None:
    QUANT_MODES[name] = installer


def parse_sites(sites, argument: str = "sites") -> tuple | None:
    """`sites=`: None, a comma-separated string of globs, or a list/tuple of glob strings (`!glob` excludes)."""
    if sites is None:
        return None
    if isinstance(sites, str):
        items = sites.split(",")
    elif isinstance(sites, (list, tuple)) and all(isinstance(s, str) for s in sites):
        items = list(sites)
    else:
        raise TypeError(f"{argument}: got {sites!r} ({type(sites).__name__}); expected None, a comma-separated string "
                        f"of globs, or a list of glob strings")
    items = [s.strip() for s in items if s.strip()]
    return tuple(items) or None


def parse_float_linears(value, argument: str = "float_linears") -> tuple | None:
    """`float_linears=`: globs as `sites=` takes them, but given means at least one, and no `!` exclusions
    (what stays float is named, not what does not)."""
    globs = parse_sites(value, argument)
    if value is not None and globs is None:
        raise ValueError(f"{argument}: got {value!r}; expected comma-separated globs over linear kinds or paths "
                         f"(e.g. 'text.q_proj'), or leave it out")
    bad = [g for g in globs or () if g.startswith("!")]
    if bad:
        raise ValueError(f"{argument}: got {bad[0]!r}; '!' exclusions are not supported here: name the linears to "
                         f"keep in the model dtype")
    return globs


def default_sites() -> tuple | None:
    """$PYPTO_GYM_SITES, parsed (None when unset): the default of `sites=` here and in the scripts."""
    return parse_sites(config.env_text("PYPTO_GYM_SITES"), "PYPTO_GYM_SITES")


def default_fuse_residual() -> bool:
    """$PYPTO_GYM_FUSE_RESIDUAL (default on): the default of `fuse_residual=` here and in the scripts."""
    return config.env_bool("PYPTO_GYM_FUSE_RESIDUAL", True)


@dataclass(frozen=True)
class PatchConfig:
    backend: str
    sites: tuple | None
    fuse_residual: bool
    cast_mode: str
    quant: str | None
    calibration: str | None
    strict: bool | None
    float_linears: tuple | None = None  # with quant: globs of linears (kinds or paths) kept in the model dtype
    release_float_weights: bool = False  # with quant: int8 linears drop their float weights (no unpatch)
    int8_lm_head: bool = False  # with quant: lm_head int8 too (what vLLM loads keeps it float: the default)
    sites_from: str = "sites"  # what a selection matching nothing is blamed on

    @classmethod
    def make(cls, backend=None, sites=None, fuse_residual=None, cast_mode="hf", quant=None, calibration=None,
             strict=None, float_linears=None, release_float_weights=False, int8_lm_head=False) -> "PatchConfig":
        """The validated options; every refusal names the argument."""
        if quant is not None and quant not in QUANT_MODES:
            raise ValueError(f"quant: got {quant!r}; expected None or one of {', '.join(map(repr, QUANT_MODES))}")
        if calibration is not None and quant is None:
            raise ValueError("calibration: given without quant='w8a8'; smooth scales only apply to int8 linears")
        float_linears = parse_float_linears(float_linears)
        if float_linears is not None and quant is None:
            raise ValueError("float_linears: given without quant='w8a8'; without it every linear is float")
        if not isinstance(release_float_weights, bool):
            raise TypeError(f"release_float_weights: got {release_float_weights!r} "
                            f"({type(release_float_weights).__name__}); expected True or False")
        if release_float_weights and quant is None:
            raise ValueError("release_float_weights: given without quant='w8a8'; only int8 linears can drop them")
        if not isinstance(int8_lm_head, bool):
            raise TypeError(f"int8_lm_head: got {int8_lm_head!r} ({type(int8_lm_head).__name__}); expected True or "
                            f"False")
        if int8_lm_head and quant is None:
            raise ValueError("int8_lm_head: given without quant='w8a8'")
        backend = registry.default_backend() if backend is None else registry.check_name(backend)
        sites_from = "sites" if sites is not None else "PYPTO_GYM_SITES"
        sites = default_sites() if sites is None else parse_sites(sites)
        fuse_residual = default_fuse_residual() if fuse_residual is None else fuse_residual
        if not isinstance(fuse_residual, bool):
            raise TypeError(f"fuse_residual: got {fuse_residual!r} ({type(fuse_residual).__name__}); expected True "
                            f"or False")
        if cast_mode not in CAST_MODES:
            raise ValueError(f"cast_mode: got {cast_mode!r}; expected one of {', '.join(map(repr, CAST_MODES))}")
        if strict is not None:
            strict = config.parse_bool("strict", strict)
        return cls(backend, sites, fuse_residual, cast_mode, quant, None if calibration is None else str(calibration),
                   strict, float_linears, release_float_weights, int8_lm_head, sites_from)

    def same(self, other: "PatchConfig") -> bool:
        return self.to_json() == other.to_json()

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("sites_from")
        d["sites"] = None if self.sites is None else list(self.sites)
        d["float_linears"] = None if self.float_linears is None else list(self.float_linears)
        return d

    def describe(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.to_json().items())
