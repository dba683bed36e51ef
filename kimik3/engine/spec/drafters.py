"""The drafters the engine can build: one branch per kind (``make_drafter``)."""

from __future__ import annotations

from kimik3.engine.config import EngineConfig
from kimik3.engine.spec.drafter import Drafter
from kimik3.engine.spec.ngram import NgramDrafter


def make_drafter(config: EngineConfig, target, num_blocks: int, draft=None,
                 draft_path: str | None = None, loaded_from_source: bool = False, num_slots: int = 1,
                 spec_slots: range = range(0)) -> Drafter | None:
    """The engine's drafter: None with speculation off (``num_speculative_tokens`` = 0), n-gram lookups, or a
    draft model (``speculative_method``): ``draft`` given, else loaded from ``speculative_model`` (MTP: the
    target's own directory, ``draft_path``, when None) and checked against ``target``. ``num_blocks``: the
    target's latent-cache blocks (a draft model's cache shares its block tables). ``loaded_from_source``: ``draft`` was
    loaded from ``speculative_model`` (or ``draft_path``), so other ranks can load it too; the drafter's ``source``
    (None for a draft given as an object). ``num_slots`` / ``spec_slots``: the target's state slots and its draft
    snapshot slots among them (``ModelDrafter``)."""
    if not config.uses_draft_model:
        if draft is not None:
            raise ValueError("a draft model was given but speculative_method is 'ngram' (or no speculative tokens)")
        return NgramDrafter(config) if config.num_speculative_tokens else None
    from kimik3.engine.spec.draft_model import ModelDrafter, load_draft     # torch models: only when used
    source = config.speculative_model or draft_path
    if draft is None:
        draft = load_draft(config.speculative_method, source, target)
    elif not loaded_from_source:
        source = None
    drafter = ModelDrafter(config, draft, num_blocks, num_slots=num_slots, spec_slots=spec_slots)
    drafter.method, drafter.source = config.speculative_method, source
    return drafter
