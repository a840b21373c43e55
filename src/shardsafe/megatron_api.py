"""``megatron.core.dist_checkpointing``'s entry points, with its names and its contract.

Code written against Megatron-Core's ``dist_checkpointing`` module can use this module in its
place (``from shardsafe import megatron_api as dist_checkpointing``): the functions take the
same arguments and return what Megatron's return, and where Megatron's contract differs from
``shardsafe.save``/``load`` these follow Megatron:

- ``save`` keeps rank 0's common state when ranks disagree on it, with a warning naming what
  differed (``shardsafe.save`` refuses with ValidationError);
- ``load`` handles every ``StrictHandling`` mode as Megatron does: keys are ShardedTensor and
  ShardedObject keys, unexpected entries are dropped from the request before loading, missing
  keys are computed over all ranks for the ``*_ALL`` modes only;
- ``load`` returns the saving rank's common state without the containers that only held its
  sharded entries (Megatron never stores them): a rank of another layout gets its own layers
  and optimizer parameter ids, not empty ones of the saving layout's;
- every error is a shardsafe error that is also Megatron-Core's ``CheckpointingException``
  when megatron-core is importable (it is imported only when an error is raised).

Strategy arguments are accepted for signature compatibility and must be None: shardsafe has one
storage format.
"""

from __future__ import annotations

import functools
import logging
import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar, cast

from .checksum import digest
from .codec import decode_inline, encode
from .dist import get_comm, outcome, raise_for
from .errors import CheckpointError, MissingKeyError, ValidationError, describe_ranks
from .loading import StrictHandling, content_metadata_of, read_manifest
from .loading import load as _load
from .megatron_async import async_request
from .reader import load_common_state_dict as _load_common_state_dict
from .reader import load_metadata
from .reader import load_plain_tensors as _load_plain_tensors
from .save_plan import tensor_digest
from .saver import async_save as _async_save
from .saver import save as _save
from .sharding import (
    CoordinatorObject,
    LocalNonPersistentObject,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
    adapt,
    format_path,
    is_plain_tensor,
)

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

CONTENT_METADATA_KEY = "content_metadata"
"""Where Megatron-LM looks for the content metadata in a loaded state dict."""


# --------------------------------------------------------------------------- errors


def _checkpointing_exception() -> type[Exception] | None:
    """Megatron-Core's ``CheckpointingException`` when megatron-core is importable, else None."""
    try:
        from megatron.core.dist_checkpointing.core import CheckpointingException
    except Exception:  # not installed, or broken: our classes alone
        return None
    return CheckpointingException


@functools.cache
def _both(ours: type[CheckpointError], theirs: type[Exception]) -> type[CheckpointError]:
    """``ours`` that is also Megatron's exception class (one class per pair)."""
    return type(ours.__name__, (ours, theirs), {"__module__": __name__, "__doc__": ours.__doc__})


def as_megatron_error(e: CheckpointError) -> CheckpointError:
    """``e`` as an instance of a class that subclasses both its class and Megatron-Core's
    ``CheckpointingException`` (``e`` itself when megatron-core is not importable)."""
    theirs = _checkpointing_exception()
    if theirs is None or isinstance(e, theirs):
        return e
    cls = _both(cast(Any, type(e)), cast(Any, theirs))  # classes hash by identity
    new = cls.__new__(cls, *e.args)
    BaseException.__init__(new, *e.args)
    new.__dict__.update(e.__dict__)
    new.__cause__, new.__context__ = e.__cause__, e.__context__
    new.__suppress_context__ = e.__suppress_context__
    return new


def megatron_errors(fn: F) -> F:
    """Raise ``fn``'s shardsafe errors as :func:`as_megatron_error` makes them."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except CheckpointError as e:
            raise as_megatron_error(e).with_traceback(e.__traceback__) from e.__cause__

    return call  # type: ignore[return-value]


def _no_strategy(**strategies: Any) -> None:
    given = [name for name, value in strategies.items() if value is not None]
    if given:
        raise ValidationError(
            f"{', '.join(given)}: shardsafe has a single storage format; pass None "
            "(Megatron-Core's strategies do not apply to shardsafe checkpoints)"
        )


# --------------------------------------------------------------------------- save


@megatron_errors
def save(
    sharded_state_dict: Any,
    checkpoint_dir: str | os.PathLike[str],
    sharded_strategy: Any = None,
    validate_access_integrity: bool = True,
    async_sharded_save: bool = False,
    preprocess_common_before_consistancy_check: Callable[[Any], Any] | None = None,
    content_metadata: Mapping[str, Any] | None = None,
    async_strategy: str | None = "nvrx",
    verify_integrity: bool = False,
    *,
    common_strategy: Any = None,
    process_group: Any = None,
) -> Any:
    """Megatron-Core's ``save``: every rank calls it; rank 0's common state is saved.

    Common state (and plain tensors) that differ between ranks are saved as rank 0 holds them,
    with a warning on every rank naming each differing value and the ranks whose copy differs
    from rank 0's (after ``preprocess_common_before_consistancy_check``, which only shapes the
    comparison, as in Megatron). Sharding is always validated and the checkpoint is always
    checksummed (``validate_access_integrity``/``verify_integrity`` cannot turn that off). The
    directory may exist if empty. With ``async_sharded_save`` the state is staged in host
    memory and written and committed in the background, and Megatron-Core's ``AsyncRequest``
    is returned for its ``AsyncCallsQueue`` (:mod:`shardsafe.megatron_async`): its first
    finalize function raises the save's error, before any Megatron-LM adds. ``async_strategy``
    is ignored (shardsafe's threads do the writing).
    """
    _no_strategy(sharded_strategy=sharded_strategy, common_strategy=common_strategy)
    comm = get_comm(process_group)
    tree = adapt(sharded_state_dict)
    if comm.distributed:
        tree = _rank0_common(comm, tree, preprocess_common_before_consistancy_check)
    if async_sharded_save:
        return async_request(
            lambda: _async_save(
                tree, checkpoint_dir, process_group=process_group, content_metadata=content_metadata
            ),
            as_megatron_error,
        )
    _save(tree, checkpoint_dir, process_group=process_group, content_metadata=content_metadata)
    return None


def _common_leaves(tree: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """The common-state leaves of a state dict (plain tensors included), with their paths."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _common_leaves(v, (*path, k))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _common_leaves(v, (*path, i))
    elif not isinstance(
        tree,
        ShardedTensor
        | ShardedObject
        | ShardedTensorFactory
        | LocalNonPersistentObject
        | CoordinatorObject,
    ):
        yield path, tree


def _leaf_digest(value: Any) -> str:
    if is_plain_tensor(value):
        return f"{value.dtype}{tuple(value.shape)}:{tensor_digest(value)}"
    try:
        enc = encode(value, "")
    except CheckpointError:  # save names what cannot be stored
        return f"unstorable {type(value).__qualname__}"
    parts = [repr(enc.node).encode(), *(bytes(b) for b in enc.blobs.values())]
    return digest(b"\0".join(parts))


def _digests(tree: Any) -> dict[str, str]:
    return {format_path(p): _leaf_digest(v) for p, v in _common_leaves(tree)}


def _rank0_common(comm: Any, tree: Any, preprocess: Callable[[Any], Any] | None) -> Any:
    """``tree`` with each common leaf that differs from rank 0's wrapped in CoordinatorObject
    (so rank 0's copy is saved), after a warning naming what differed (Megatron's contract)."""
    mine, err = outcome(
        lambda: (_digests(tree), _digests(preprocess(_common_view(tree))) if preprocess else None)
    )
    comm.arrive("save (common state check)", 1800.0)
    records = comm.all_gather({"error": err, "digests": mine})
    raise_for([r["error"] for r in records], "save (common state check)")
    every = [r["digests"][0] for r in records]
    shown = [r["digests"][1] for r in records] if preprocess else every
    differing = _differing(every)
    reported = _differing(shown)
    if reported:
        parts = [f"{name} ({', '.join(f'rank {r}' for r in ranks)})" for name, ranks in reported]
        warnings.warn(
            "common state differs from rank 0's, which is what is saved (Megatron-Core's "
            f"contract): {'; '.join(parts[:20])}"
            + (f" and {len(parts) - 20} more" if len(parts) > 20 else ""),
            stacklevel=4,  # the caller of save
        )
    names = {name for name, _ in differing}
    if not names:
        return tree
    return _wrap(tree, (), names)


def _common_view(node: Any) -> Any:
    """The common state dict as Megatron hands it to ``preprocess_common_before_consistancy_check``:
    the tree without sharded and non-persistent entries (lists closed up)."""
    sharded = (ShardedTensor, ShardedObject, ShardedTensorFactory, LocalNonPersistentObject)
    if isinstance(node, dict):
        return {k: _common_view(v) for k, v in node.items() if not isinstance(v, sharded)}
    if isinstance(node, list):
        return [_common_view(v) for v in node if not isinstance(v, sharded)]
    return node


def _differing(every: list[dict[str, str]]) -> list[tuple[str, list[int]]]:
    """``(value name, ranks whose copy differs from rank 0's)``, rank 0's names first."""
    names = list(every[0]) + sorted(set().union(*every[1:]) - set(every[0]))
    out = []
    for name in names:
        ranks = [r for r in range(1, len(every)) if every[r].get(name) != every[0].get(name)]
        if ranks:
            out.append((name, ranks))
    return out


def _wrap(node: Any, path: tuple[Any, ...], names: set[str]) -> Any:
    if isinstance(node, dict):
        return {k: _wrap(v, (*path, k), names) for k, v in node.items()}
    if isinstance(node, list):
        return [_wrap(v, (*path, i), names) for i, v in enumerate(node)]
    return CoordinatorObject(node) if format_path(path) in names else node


# --------------------------------------------------------------------------- load


@megatron_errors
def load(
    sharded_state_dict: Any,
    checkpoint_dir: str | os.PathLike[str],
    sharded_strategy: Any = None,
    validate_access_integrity: bool = True,
    strict: StrictHandling | str = StrictHandling.ASSUME_OK_UNEXPECTED,
    verify_integrity: bool = False,
    process_group: Any = None,
    *,
    common_strategy: Any = None,
) -> Any:
    """Megatron-Core's ``load``, ``strict`` modes included (see the module doc).

    Reads shardsafe checkpoints and Megatron ``torch_dist`` directories. Every block read is
    checksummed whatever ``verify_integrity`` says; ``validate_access_integrity`` is accepted
    (a request is never written, so nothing depends on it).
    """
    _no_strategy(sharded_strategy=sharded_strategy, common_strategy=common_strategy)
    try:
        mode = StrictHandling(strict.value if isinstance(strict, StrictHandling) else strict)
    except ValueError:
        raise ValidationError(
            f"invalid strict flag {strict!r}; use one of {[m.value for m in StrictHandling]}"
        ) from None
    missing: set[str] = set()
    unexpected: set[str] = set()
    template = adapt(sharded_state_dict)
    if mode != StrictHandling.ASSUME_OK_UNEXPECTED:
        template, missing, unexpected = _strict_check(template, checkpoint_dir, mode, process_group)
    result = _load(
        template,
        checkpoint_dir,
        process_group=process_group,
        strict=StrictHandling.ASSUME_OK_UNEXPECTED,
    )
    from .integrations.megatron import is_torch_dist_dir

    if not is_torch_dist_dir(checkpoint_dir):
        _drop_saved_layout(result, template, read_manifest(checkpoint_dir)[0].common)
    if mode.returns:
        return result, missing, unexpected
    return result


def _hollow(enc: Any) -> bool:
    """Whether an encoded common-state value only marks where sharded entries stood: a
    placeholder, a list of them, or a dict whose entries were all sharded (saved empty)."""
    if isinstance(enc, dict) and set(enc) == {"$sharded"}:
        return True
    if isinstance(enc, list):
        return bool(enc) and all(_hollow(v) for v in enc)
    if isinstance(enc, dict) and set(enc) == {"$dict"} and isinstance(enc["$dict"], list):
        return all(isinstance(kv, list) and len(kv) == 2 and _hollow(kv[1]) for kv in enc["$dict"])
    return False


def _drop_saved_layout(result: Any, template: Any, enc: Any) -> None:
    """Remove from ``result`` (in place) what came from the common state of the saving rank and
    only holds the places of its sharded entries: a rank of another layout requests other
    layers and parameter ids, and Megatron's common state never holds such containers (a
    torch optimizer would take ``state[7] = {}`` for a parameter this rank does not have).

    A dict the template asks for is walked; a stored key it does not ask for is dropped when
    its value is hollow (:func:`_hollow`). An empty dict stored under such a key is dropped
    too: the format does not tell it from a dict whose entries were all sharded.
    """
    if isinstance(result, dict) and isinstance(template, dict) and isinstance(enc, dict):
        pairs = enc.get("$dict")
        if not isinstance(pairs, list):
            return
        for pair in pairs:
            if not (isinstance(pair, list) and len(pair) == 2):
                continue
            try:
                key = decode_inline(pair[0], "common state key")
                hash(key)
            except (CheckpointError, TypeError):
                continue
            if key not in result:
                continue
            if key in template:
                _drop_saved_layout(result[key], template[key], pair[1])
            elif _hollow(pair[1]):
                del result[key]
    elif isinstance(result, list) and isinstance(template, list) and isinstance(enc, list):
        for r, t, e in zip(result, template, enc, strict=False):
            _drop_saved_layout(r, t, e)


def _requested_keys(tree: Any) -> set[str]:
    """The ShardedTensor/ShardedObject keys a template asks for (factories built), as Megatron
    counts them."""
    keys: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, ShardedTensorFactory):
            walk(node.build())
        elif isinstance(node, dict):
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)
        elif isinstance(node, ShardedTensor | ShardedObject):
            keys.add(node.key)

    walk(tree)
    return keys


def _stored_keys(path: str | os.PathLike[str]) -> set[str]:
    """The ShardedTensor/ShardedObject keys a checkpoint holds (objects by key, not unique key)."""
    from .integrations.megatron import is_torch_dist_dir

    if is_torch_dist_dir(path):
        from .convert.dcp import DcpSource

        source = DcpSource(path)
        return set(source.tensor_keys()) | {
            ukey.rsplit("/shard_", 1)[0] for ukey in source.object_keys()
        }
    return {entry.key for entry in load_metadata(path).values()}


def _without_keys(node: Any, keys: set[str]) -> Any:
    """The template without the sharded entries keyed ``keys`` (Megatron's
    ``adjust_non_strict_load``: dict entries removed, lists closed up, containers emptied by the
    removal dropped)."""
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            if isinstance(v, ShardedTensor | ShardedObject) and v.key in keys:
                continue
            kept = _without_keys(v, keys)
            if isinstance(v, dict | list) and v and not kept:
                continue
            out[k] = kept
        return out
    if isinstance(node, list):
        items = []
        for v in node:
            if isinstance(v, ShardedTensor | ShardedObject) and v.key in keys:
                continue
            kept = _without_keys(v, keys)
            if isinstance(v, dict | list) and v and not kept:
                continue
            items.append(kept)
        return items
    return node


def _strict_check(
    template: Any,
    path: str | os.PathLike[str],
    mode: StrictHandling,
    process_group: Any,
    timeout: float = 1800.0,
) -> tuple[Any, set[str], set[str]]:
    """Megatron's ``validate_integrity_and_strict_load``: unexpected keys (this rank's request,
    absent from the checkpoint) are dropped from the template; missing keys (in the checkpoint,
    requested by no rank) are computed for the ``*_ALL`` modes; then raise, log or return."""
    comm = get_comm(process_group)

    def local() -> tuple[set[str], set[str]]:
        requested = _requested_keys(template)
        stored = _stored_keys(path)
        return requested, stored

    mine, err = outcome(local)
    comm.arrive("load (strict check)", timeout)
    records = comm.all_gather({"error": err, "requested": sorted(mine[0]) if mine else []})
    raise_for([r["error"] for r in records], "load (strict check)")
    assert mine is not None
    requested, stored = mine
    unexpected = requested - stored
    missing: set[str] = set()
    if mode.needs_missing:
        everyone = set().union(*(set(r["requested"]) for r in records))
        missing = stored - everyone
    template = _without_keys(template, unexpected)
    if mode == StrictHandling.IGNORE_ALL:
        return template, set(), set()
    # every rank knows every rank's request: all raise together (a rank left out would wait
    # for the others in the load)
    others = [r for r, rec in enumerate(records) if set(rec["requested"]) - stored]
    if mode in (StrictHandling.RAISE_UNEXPECTED, StrictHandling.RAISE_ALL) and (missing or others):
        extra = [f"{describe_ranks(others)} request keys the checkpoint does not hold"]
        raise MissingKeyError(
            _mismatch_message(os.fspath(path), missing, unexpected, extra if others else [])
        )
    if mode in (StrictHandling.LOG_UNEXPECTED, StrictHandling.LOG_ALL) and (missing or unexpected):
        log.warning("%s", _mismatch_message(os.fspath(path), missing, unexpected))
    return template, missing, unexpected


def _mismatch_message(
    path: str, missing: set[str], unexpected: set[str], extra: list[str] | None = None
) -> str:
    parts: list[str] = []
    if missing:
        parts.append(
            f"{len(missing)} checkpoint keys are requested by no rank (missing): {sorted(missing)[:10]}"
        )
    if unexpected:
        parts.append(
            f"{len(unexpected)} keys this rank requests are not in the checkpoint (unexpected): "
            f"{sorted(unexpected)[:10]}"
        )
    return f"{path}: " + "; ".join(parts + (extra or []))


# --------------------------------------------------------------------------- metadata


@megatron_errors
def load_common_state_dict(checkpoint_dir: str | os.PathLike[str]) -> Any:
    """The common state, read by this process alone (Megatron ``torch_dist`` directories too)."""
    from .integrations.megatron import is_torch_dist_dir

    if is_torch_dist_dir(checkpoint_dir):
        from .convert.dcp import DcpSource

        return DcpSource(checkpoint_dir).megatron_common()
    return _load_common_state_dict(checkpoint_dir)


@megatron_errors
def load_plain_tensors(checkpoint_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Every tensor whole under its key, plus the common state's top-level entries."""
    return _load_plain_tensors(checkpoint_dir)


@megatron_errors
def load_tensors_metadata(
    checkpoint_dir: str | os.PathLike[str], sharded_strategy: Any = None
) -> dict[str, ShardedTensor]:
    """``{tensor key: ShardedTensor}`` without data, each one piece of its global shape and dtype."""
    _no_strategy(sharded_strategy=sharded_strategy)
    return {k: v for k, v in load_metadata(checkpoint_dir).items() if isinstance(v, ShardedTensor)}


@megatron_errors
def load_sharded_metadata(
    checkpoint_dir: str | os.PathLike[str],
    sharded_strategy: Any = None,
    common_strategy: Any = None,
) -> dict[str, ShardedTensor | ShardedObject]:
    """:func:`load_tensors_metadata` plus every ShardedObject, keyed by its unique key."""
    _no_strategy(sharded_strategy=sharded_strategy, common_strategy=common_strategy)
    return load_metadata(checkpoint_dir)


@megatron_errors
def load_content_metadata(
    checkpoint_dir: str | os.PathLike[str] | None = None,
    *,
    preloaded_state_dict: Mapping[str, Any] | None = None,
) -> dict[str, Any] | None:
    """The ``content_metadata`` given to ``save``; None when the checkpoint has none.

    With ``preloaded_state_dict`` (what ``load`` returned) nothing is read: ``load`` places the
    content metadata under ``"content_metadata"``, as Megatron-Core does.
    """
    if preloaded_state_dict is not None:
        value = preloaded_state_dict.get(CONTENT_METADATA_KEY)
        return value if isinstance(value, dict) else None
    if checkpoint_dir is None:
        raise ValidationError(
            "load_content_metadata needs checkpoint_dir or preloaded_state_dict (both are None)"
        )
    from .integrations.megatron import is_torch_dist_dir

    if is_torch_dist_dir(checkpoint_dir):
        from .convert.dcp import DcpSource

        value = DcpSource(checkpoint_dir).megatron_common().get(CONTENT_METADATA_KEY)
        return value if isinstance(value, dict) else None
    manifest, _ = read_manifest(checkpoint_dir)
    return content_metadata_of(manifest, os.fspath(checkpoint_dir))


@megatron_errors
def apply_factories(sharded_state_dict: Any) -> None:
    """Replace every ShardedTensorFactory by what it builds, *in place* (Megatron's contract)."""

    def walk(node: Any) -> None:
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for k, v in list(items):
            while isinstance(v, ShardedTensorFactory):
                v = v.build()
                node[k] = v
            if isinstance(v, dict | list):
                walk(v)

    if not isinstance(sharded_state_dict, dict | list):
        raise ValidationError(
            f"apply_factories works in place on a dict or list, got {type(sharded_state_dict).__name__}"
        )
    walk(sharded_state_dict)


@megatron_errors
def apply_factory_merges(x1: Any, x2: Any, key: tuple[Any, ...] = ()) -> Any:
    """Merge the loaded ``x1`` with the factories of ``x2`` in place; returns ``x1`` (Megatron's contract).

    Each factory of ``x2`` turns the subtree of ``x1`` at its place into one value with its
    ``merge_fn``. Structures that do not line up raise :class:`ValidationError` naming the path.
    """
    where = "state_dict" + "".join(f"[{p!r}]" for p in key)
    if isinstance(x2, ShardedTensorFactory):
        return x2.merge_fn(x1)
    if isinstance(x1, dict) and isinstance(x2, dict):
        for k, v2 in x2.items():
            if k not in x1:
                raise ValidationError(
                    f"{where}: the loaded state dict has no key {k!r} (it has {sorted(map(str, x1))[:10]})"
                )
            x1[k] = apply_factory_merges(x1[k], v2, (*key, k))
    elif isinstance(x1, list) and isinstance(x2, list):
        if len(x1) != len(x2):
            raise ValidationError(f"{where}: lists of different lengths ({len(x1)} and {len(x2)})")
        for i, v2 in enumerate(x2):
            x1[i] = apply_factory_merges(x1[i], v2, (*key, i))
    elif isinstance(x1, list) and isinstance(x2, dict):
        for k, v2 in x2.items():
            if not isinstance(k, int) or not 0 <= k < len(x1):
                raise ValidationError(
                    f"{where}: key {k!r} does not index the loaded list of length {len(x1)}"
                )
            x1[k] = apply_factory_merges(x1[k], v2, (*key, k))
    else:
        raise ValidationError(
            f"{where}: cannot merge a loaded {type(x1).__name__} with a {type(x2).__name__} template"
        )
    return x1
