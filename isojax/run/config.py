"""One configuration object per measuring run: `MeasureConfig`, frozen and nested (data, model,
stats, kernels, devices, checkpoint), built by `python -m isojax.extract`, by sweeps and by notebook
users, and passed whole to `isojax.measure(config)`.

    config = MeasureConfig.build("pythia-70m", ["corpus.jsonl"], max_tokens=10**6, centered=True)
    results = isojax.measure(config)

`MeasureConfig.build` takes the keyword arguments `isojax.measure(model, data, **kwargs)` always
took; `measure` records the kernels it chose in `Results.config` (kernels.attention, mlp, norm).
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """data: paths or hub: specs (None: CPython's bundled documentation); unit: sentence, paragraph
    or document; sources: the sources to keep; seq_len: tokens per row; batch_tokens: token slots
    per step over all devices; max_tokens: the tokens measured, an equal share for each source;
    max_tokens_per_source: each source's share (with max_tokens: at most this); bos: auto, on or off,
    the tokenizer's BOS token before each unit (auto: where Hugging Face's tokenizer adds it by
    default; hf.tokenizer.tokenizer_bos)."""
    data: Any = None
    unit: str = "sentence"
    sources: Any = None
    seq_len: int | None = None
    batch_tokens: int | None = None
    max_tokens: int | None = None
    max_tokens_per_source: int | None = None
    bos: str = "auto"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """model: preset, random:<preset>, directory, hub id or a LoadedModel (None: pythia-70m);
    revision: a hub revision; dtype: float32 or bfloat16 (None: the platform's default)."""
    model: Any = None
    revision: str | None = None
    dtype: str | None = None


@dataclasses.dataclass(frozen=True)
class StatsConfig:
    """token_stats: per-token IntraSim; centered: a second pass for centred metrics;
    save_token_sums: write the per-token unit sums; sample_states: K sampled states (None: the
    platform's default, 0: none); intrinsic_k: neighbours of the intrinsic-dimension estimators;
    isoscore_zeta: IsoScore*'s covariance shrinkage, 0 to 1 (stats/measures/isoscore_star.py).
    skip_positions: the first K positions of every sequence are left out of every statistic.
    sentence_probe: the per-sentence measures of the papers on a fixed subset (stats/sentences.py).
    step_measures: the settings given of the step measures (stats/measures base.Step), as (keyword,
    value) pairs of isojax.measure's keywords (logit_lens_every=K: the logit lens on every K-th token
    of each sequence, 1: every token, 0: off); the others take their defaults (step_settings)."""
    token_stats: bool = True
    centered: bool = False
    save_token_sums: bool = False
    sample_states: int | None = None
    intrinsic_k: int = 20
    isoscore_zeta: float = 0.75  # stats/measures/isoscore_star.py ZETA: Rudman & Eickhoff (2024)
    skip_positions: int = 0
    sentence_probe: bool = False
    step_measures: tuple = ()
    measures: tuple[str, ...] = ()  # registered read-out measures off by default, turned on (--measure)

    def step_settings(self) -> tuple[tuple[str, int], ...]:
        """StatsOptions.step_measures of this run: (module name, setting) of each step measure on
        (measures.step_settings; ValueError for a setting that is not a non-negative integer)."""
        from isojax.stats.measures import step_settings
        return step_settings(self.step_measures, self.token_stats)


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """attention: auto, xla, cudnn, pallas or packed; mlp: auto, xla or mosaic; norm: auto, xla or
    pallas. A run's Results.config holds the ones chosen (never auto)."""
    attention: str = "auto"
    mlp: str = "auto"
    norm: str = "auto"


@dataclasses.dataclass(frozen=True)
class DeviceConfig:
    """mesh: {"data": N, "model": M}, one of them, or None (chosen from the devices' memory)."""
    mesh: Any = None


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """directory: where checkpoints go (None: none); every_tokens: how often; resume: continue the
    run checkpointed in directory."""
    directory: Any = None
    every_tokens: int | None = None
    resume: bool = False


@dataclasses.dataclass(frozen=True)
class MeasureConfig:
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    stats: StatsConfig = StatsConfig()
    kernels: KernelConfig = KernelConfig()
    devices: DeviceConfig = DeviceConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    progress: bool = True

    @classmethod
    def build(cls, model=None, data=None, *, revision=None, unit: str = "sentence", sources=None, dtype=None,
              seq_len=None, batch_tokens=None, max_tokens=None, token_stats: bool = True, centered: bool = False,
              save_token_sums: bool = False, attention: str = "auto", mlp_kernel: str = "auto",
              norm_kernel: str = "auto", mesh=None, checkpoint_dir=None, checkpoint_every_tokens=None,
              resume_run: bool = False, progress: bool = True, sample_states: int | None = None,
              intrinsic_k: int = 20, max_tokens_per_source=None, isoscore_zeta: float = 0.75,
              skip_positions: int = 0, bos: str = "auto", sentence_probe: bool = False,
              measures=(), **step_measures) -> MeasureConfig:
        """The config of `isojax.measure(model, data, **kwargs)`'s keyword arguments; step_measures: the
        step measures' keywords (base.Step.keyword: logit_lens_every=K, ...)."""
        from isojax.stats.measures import steps
        keywords = [step.keyword for step in steps().values()]
        unknown = [k for k in step_measures if k not in keywords]
        if unknown:
            raise TypeError(f"measure() got an unexpected keyword argument {unknown[0]!r}")
        return cls(data=DataConfig(data, unit, sources, seq_len, batch_tokens, max_tokens, max_tokens_per_source, bos),
                   model=ModelConfig(model, revision, dtype),
                   stats=StatsConfig(token_stats, centered, save_token_sums, sample_states, intrinsic_k,
                                     isoscore_zeta, skip_positions, sentence_probe, tuple(step_measures.items()),
                                     (measures,) if isinstance(measures, str)
                                     else tuple(measures) if isinstance(measures, (list, tuple)) else measures),
                   kernels=KernelConfig(attention, mlp_kernel, norm_kernel),
                   devices=DeviceConfig(mesh),
                   checkpoint=CheckpointConfig(checkpoint_dir, checkpoint_every_tokens, resume_run),
                   progress=progress)

    def replace(self, **parts) -> MeasureConfig:
        """A copy with parts replaced by name: `config.replace(model=dict(revision="step1000"))`
        (a dict updates that part's fields, a part object replaces it)."""
        out = {}
        for name, value in parts.items():
            old = getattr(self, name)
            out[name] = dataclasses.replace(old, **value) if isinstance(value, dict) else value
        return dataclasses.replace(self, **out)


def cli_options(args) -> dict:
    """MeasureConfig.build's keyword arguments from extract's command line (extract.build_parser),
    but the model's, revision's and checkpoints': a run's and a dry run's plans read them one way."""
    from isojax.device.mesh import parse_mesh
    from isojax.stats.measures import steps
    given = {step.keyword: step.setting(args) for step in steps().values()}
    return dict(data=args.data, unit=args.unit, sources=args.source, dtype=args.dtype, seq_len=args.seq_len,
                batch_tokens=args.batch_tokens, max_tokens=args.max_tokens,
                max_tokens_per_source=args.max_tokens_per_source, token_stats=not args.no_token_stats,
                centered=args.centered, save_token_sums=args.save_token_sums, attention=args.attention,
                mlp_kernel=args.mlp_kernel, norm_kernel=args.norm_kernel, mesh=parse_mesh(args.mesh) or None,
                checkpoint_every_tokens=args.checkpoint_every_tokens,
                sample_states=0 if args.no_sample else args.sample_states, intrinsic_k=args.intrinsic_k,
                isoscore_zeta=args.isoscore_zeta, skip_positions=args.skip_positions, bos=args.bos,
                sentence_probe=args.sentence_probe,
                measures=tuple(name for names in args.measure for name in names.split(",") if name),
                **{keyword: value for keyword, value in given.items() if value is not None})
