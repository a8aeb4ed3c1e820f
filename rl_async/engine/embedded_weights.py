"""Weight updates of the embedded engine: staged publications, and direct loads.

A mixin of `EmbeddedEngine` (split out to keep files small). A publication is a transaction
(rl_async/loop/publish.py), and the engine's part of it runs while it keeps generating:

    stage_weights    prepare + transfer + verify, outside the step lock: every bucket is
                     received into a STAGING buffer (never the one the parameters are views
                     of), its fingerprint taken (rl_async.state.weights.bucket_fingerprint)
                     and compared with the trainer's, the whole model's digest compared with
                     the snapshot's, and what the next weights need before they serve (the
                     oneDNN packing of the linears) prepared. Buckets arrive in pieces
                     (`chunk_bytes`): piece k+1 is received while piece k's rows are
                     fingerprinted and the linears it completed are packed, so only the
                     last piece's rows are left once the last byte lands (its linears are
                     packed after the switch: see commit_weights). Generation goes on under
                     the old weights meanwhile; nothing it reads is touched.
    commit_weights   the switch, under the step lock (between two steps): the parameters
                     become views of the staged buffers, the packed linears are swapped in,
                     the version is set, the prompt cache emptied and running requests
                     retracted. Only this is a pause, and it copies nothing. A step after it
                     samples, and stamps, with the new version. Linears whose packing is
                     still under way run on torch's stock kernel over the new weights until
                     it is installed between two later steps.

Until commit the engine serves its committed version; a transfer that fails or does not
verify is simply never committed (the next stage overwrites it). Two buffers per bucket
(one live, one staging) are the price: twice the weights' memory once a second version
arrived.

`update_weights_from_distributed` (one bucket per call, SGLang's API) and
`update_weights_from_tensor` load at once, without a transaction.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from rl_async.state import collective
from rl_async.engine.base import EngineError
from rl_async.engine.relay import Forwarder, pieces
from rl_async.engine.staged import BucketCheck, StagedWeights
from rl_async.state.weights import bucket_nbytes, model_digest, unflatten_bucket

logger = logging.getLogger(__name__)


class EngineWeightsMixin:
    """Needs from the engine: `device`, `_params`, `_version`, `_linears`, `_guard()`,
    `_weights_changed()`, `_retract_running()`, `prefix_cache`."""

    def _init_weights(self) -> None:
        # Two buffers per bucket: the parameters are views of the live one; a staged
        # publication waits in the other until commit.
        self._slots: dict[tuple[str, ...], list[torch.Tensor]] = {}
        self._live: dict[tuple[str, ...], int] = {}
        self._staged: StagedWeights | None = None
        self.committed_digest: str | None = None  # model digest of the committed version
        self.debug_faults: dict = {}  # fault-injection tests only (EngineActor.debug_fault)
        self._joined: set[str] = set()  # publication channels and links joined
        self._relay_stores: dict = {}  # relay links opened (hosted), not yet joined
        self._check_pool: ThreadPoolExecutor | None = None  # stage_weights' checking thread
        self._late_pack: asyncio.Future | None = None  # a commit's packing under way
        self._late_task: asyncio.Task | None = None  # installs it when done

    async def init_weights_update_group(self, master_address: str, master_port: int,
                                        rank_offset: int, world_size: int, group_name: str,
                                        backend: str, timeout_s: float | None = None) -> None:
        # The rendezvous blocks until every rank joined: keep the event loop free meanwhile.
        # The timeout also bounds each receive: gloo cannot abort a pending receive
        # (ProcessGroup.abort/shutdown leave it waiting), so it is the only way out of a
        # broadcast whose sender gave up when another engine died in the middle of it.
        await asyncio.to_thread(collective.init_custom_process_group, backend,
                                f"tcp://{master_address}:{master_port}", world_size,
                                rank_offset, group_name, timeout_s)
        self._joined.add(group_name)

    async def destroy_weights_update_group(self, group_name: str) -> None:
        collective.destroy_group(group_name)
        self._joined.discard(group_name)

    def weight_update_groups(self) -> list[str]:
        return sorted(self._joined)

    def _group(self, group_name: str, what: str):
        if group_name not in self._joined:
            raise EngineError(f"{what}: channel {group_name!r} was never joined by this "
                              f"engine (joined: {self.weight_update_groups()})")
        return collective.get_group(group_name)

    def _staging_buffer(self, key: tuple[str, ...], nbytes: int) -> tuple[int, torch.Tensor]:
        """The buffer of bucket `key` the parameters are NOT views of: (slot, buffer)."""
        slots = self._slots.setdefault(key, [])
        slot = 1 - self._live[key] if key in self._live else 0
        while len(slots) <= slot:
            slots.append(torch.empty(nbytes, dtype=torch.uint8, device=self.device))
        return slot, slots[slot]

    # ---- the staged transaction ----------------------------------------------------------
    async def stage_weights(self, buckets: list[tuple], group_name: str, version: int,
                            fingerprints: list[str], digest: str, forward: str | None = None,
                            chunk_bytes: int = 0, relayed: bool = False) -> dict:
        """Prepare, transfer and verify a publication of `version` (module docstring);
        generation goes on meanwhile. Every bucket is received even after one failed its
        check, so the sender is never left waiting. Returns {"verified", "error", "digest",
        "receive_seconds", "load_seconds", "upstream_failed", "forward_error"};
        commit_weights installs a verified one.

        Relay (rl_async/engine/relay.py): buckets arrive in pieces of `chunk_bytes` over
        `group_name`, from trainer rank 0 or (`relayed`) from the engine before this one,
        and each piece is forwarded on link `forward`. A failed receive from an engine is
        reported (`upstream_failed`), not raised: this engine is fine, its upstream is not."""
        source = self._group(group_name, "stage_weights")
        self._check_version(version)
        # Faults armed for "the next publication" take effect here, never inside one that
        # is already under way: arming one mid-transfer would kill the process before the
        # arming call's own reply left it.
        self.debug_faults.update(self.debug_faults.pop("next_publication", {}))
        self._staged = None  # an older staging that was never committed is dropped
        if forward is not None:
            self._group(forward, "stage_weights (relay link)")  # joined, or a clear error
        forwarder = Forwarder(forward)
        count, start = len(buckets), time.perf_counter()
        staged = StagedWeights(version, digest)
        checks: list[asyncio.Future] = []
        try:
            for i, (names, dtypes, shapes, *_rest) in enumerate(buckets):
                slot, flat = self._staging_buffer(tuple(names), bucket_nbytes(dtypes, shapes))
                if "before_bucket" in self.debug_faults:
                    self.debug_faults["before_bucket"](i)
                staged.buckets.append((tuple(names), slot, []))
                check = BucketCheck(self, staged, i, count, flat, (names, dtypes, shapes),
                                     fingerprints[i])
                landed, cut = 0, pieces(flat, chunk_bytes)
                for k, piece in enumerate(cut):
                    await asyncio.to_thread(torch.distributed.broadcast, piece, group=source,
                                            group_src=0)
                    if landed == 0 and self.debug_faults.get("corrupt_bucket") == i:
                        del self.debug_faults["corrupt_bucket"]
                        flat[0] ^= 0xFF  # as a bit flip in transit would
                    forwarder.send(piece)
                    landed += piece.numel()
                    # fingerprinted and packed beside the next piece's receive, in order;
                    # the very last piece's linears are packed after the check (commit)
                    last = i == count - 1 and k == len(cut) - 1
                    checks.append(self._in_check_thread(check.landed, landed, not last))
                checks.append(self._in_check_thread(check.finish))
            if self._linears is not None and count:
                staged.late = self._in_check_thread(check.pack_rest)
        except Exception as exc:
            if not relayed:
                raise  # the trainer's channel: the fleet hears of it from both ends
            await asyncio.gather(*checks, return_exceptions=True)
            return {"verified": False, "upstream_failed": True, "digest": None,
                    "error": f"receiving from the engine before it in the relay: "
                             f"{type(exc).__name__}: {exc}", "forward_error": None,
                    "receive_seconds": time.perf_counter() - start, "load_seconds": 0.0}
        received = time.perf_counter()
        results = [r for r in await asyncio.gather(*checks) if r is not None]
        forward_error = await forwarder.finish()
        errors = [e for e, _ in results if e]
        got = model_digest(buckets, [fp for _, fp in results])
        if not errors and got != digest:
            errors.append(f"the model digest {got[:12]} is not the snapshot's {digest[:12]}")
        if not errors:
            self._staged = staged
        return {"verified": not errors, "error": "; ".join(errors) or None, "digest": got,
                "upstream_failed": False, "forward_error": forward_error,
                "receive_seconds": received - start,
                "load_seconds": time.perf_counter() - received}

    # ---- relay links (rank 0 of a link is the forwarding engine) ---------------------------
    def open_relay(self, name: str, timeout_s: float) -> int:
        """Host the rendezvous of relay link `name`, to the next engine; returns the port."""
        if name in self._joined or name in self._relay_stores:
            raise EngineError(f"relay link {name!r} is already open on this engine")
        store = collective.create_store(timeout_s)
        self._relay_stores[name] = (store, timeout_s)
        return store.port

    async def join_relay(self, name: str) -> None:
        """Join relay link `name` as its rank 0, once the next engine joins as rank 1."""
        store, timeout_s = self._relay_stores.pop(name)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        await asyncio.to_thread(collective.init_custom_process_group, backend, None, 2, 0,
                                name, timeout_s, store=store)
        self._joined.add(name)

    def _in_check_thread(self, fn, *args) -> asyncio.Future:
        """Run fn(*args) on the engine's one checking thread: the pieces of a publication
        are fingerprinted and packed in the order they landed, off the event loop."""
        if self._check_pool is None:
            self._check_pool = ThreadPoolExecutor(1, thread_name_prefix="stage-check")
        return asyncio.get_running_loop().run_in_executor(self._check_pool, fn, *args)

    async def commit_weights(self, version: int) -> dict:
        """The switch to the verified staged `version` (module docstring); returns the
        seconds no step could run ({"pause_seconds"}). Committing the version already held
        is a no-op (a retried commit)."""
        replaced: list = []  # the old weights' memory, released after the pause and reply
        async with self._guard():
            begun = time.perf_counter()
            if self._staged is None or self._staged.version != version:
                if version == self._version and self._staged is None:
                    return {"pause_seconds": 0.0}
                raise EngineError(f"commit_weights({version}): no verified staged weights "
                                  f"of that version (staged: "
                                  f"{self._staged.version if self._staged else None}); "
                                  f"a version is committed only after stage_weights "
                                  f"verified it")
            staged, self._staged = self._staged, None
            changed: set[int] = set()  # the parameters whose weights change
            with torch.no_grad():
                for key, slot, named in staged.buckets:
                    for name, tensor in named:
                        replaced.append(self._install(name, tensor))
                        changed.add(id(self._params[name]))
                    self._live[key] = slot
            if self._linears is not None:
                replaced += self._commit_packed(staged, changed)
            self._version = version
            self.committed_digest = staged.digest
            self._forget_old_kv()
            pause = time.perf_counter() - begun
        # returning the old packed copies' memory (tens of MB) is not the caller's wait
        self._in_check_thread(replaced.clear)
        return {"pause_seconds": pause}

    def _commit_packed(self, staged: StagedWeights, changed: set[int]) -> list:
        """Install the packed linears of the new weights (under the step lock). The ones
        whose bytes came last may still be packing (`staged.late`): rather than hold the
        new version back for them, those linears run on the stock kernel over their new
        weights until their packed copies are installed between two later steps (never a
        packed copy of old weights: LESSONS miles#2782)."""
        late = staged.late
        if late is not None and late.done():
            if late.exception() is None:
                staged.packed.update(late.result())
            late = None
        self._late_pack = late
        if late is not None:
            self._late_task = asyncio.ensure_future(self._install_late(late))
        return self._linears.install(staged.packed, changed)

    def _repack_all(self) -> None:
        """After a direct weight load: every linear packed from the parameters as they are
        now; a staged commit's packing still under way is superseded."""
        if self._linears is not None:
            self._late_pack = None
            self._linears.refresh()

    def _close_weights(self) -> None:
        if self._check_pool is not None:
            self._check_pool.shutdown(wait=False)

    async def _install_late(self, late: asyncio.Future) -> None:
        begun = time.perf_counter()
        try:
            packed = await late
        except Exception:  # noqa: BLE001 -- those linears stay on the stock kernel
            logger.exception("packing the committed weights' last linears failed; they run "
                             "on torch's stock kernel until the next weight update")
            return
        async with self._guard():
            if self._late_pack is not late:
                return  # superseded by a newer commit or load (which packs its own)
            self._late_pack = None
            replaced = self._linears.install(packed)
        self.stats["late_pack_seconds"] = time.perf_counter() - begun
        del replaced

    def _forget_old_kv(self) -> None:
        """No KV computed under the old weights serves again: the prompt cache is emptied
        and running requests retracted (rebuilt under the new weights). The fault
        `keep_prompt_cache` keeps the prompt cache instead: the provenance audit's negative
        control (tests only)."""
        kept = self.prefix_cache if self.debug_faults.get("keep_prompt_cache") else None
        if kept is not None:  # the clears below then empty a throwaway
            self.prefix_cache = type(kept)(kept.max_tokens)
        self.prefix_cache.clear()
        self._retract_running()
        if kept is not None:
            self.prefix_cache = kept

    def _install(self, name: str, tensor: torch.Tensor) -> torch.Tensor | None:
        """Parameter `name` becomes `tensor` (a view of the staged buffer: no copy); returns
        what it held before (the caller decides when that memory goes)."""
        param = self._params[name]
        if tensor.dtype == param.dtype and tensor.device == param.device:
            old, param.data = param.data, tensor
            return old
        param.copy_(tensor.to(param.device))
        return None

    # ---- direct loads --------------------------------------------------------------------
    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str],
                                              shapes: list[list[int]], group_name: str,
                                              weight_version: int | None = None, *,
                                              flush_cache: bool | None = None) -> None:
        """One bucket, loaded at once. `flush_cache` is moot here: every load retracts
        running requests and empties the prompt cache (`_weights_changed`), so no KV of old
        weights survives. Load every bucket of a publication while paused: a request
        admitted between two would run on half-updated weights (stage_weights has none)."""
        group = self._group(group_name, "update_weights_from_distributed")
        key = tuple(names)
        # Received outside the lock into the buffer not in use (generation may go on), then
        # bound under it. Always take part in the broadcast (the sender would hang), check
        # after.
        slot, flat = self._staging_buffer(key, bucket_nbytes(dtypes, shapes))
        await asyncio.to_thread(torch.distributed.broadcast, flat, group=group, group_src=0)
        self._check_names(names, shapes)
        named = unflatten_bucket(flat, names, dtypes, shapes)
        async with self._guard():
            self._set_version(weight_version)
            with torch.no_grad():
                for name, tensor in named:
                    self._install(name, tensor)
            self._live[key] = slot
            self._weights_changed()
            self._retract_running()

    def _check_version(self, weight_version: int | None) -> None:
        if weight_version is not None and (not isinstance(weight_version, int)
                                           or weight_version < self._version):
            raise ValueError(f"weight_version = {weight_version!r}: must be an int >= the "
                             f"current version {self._version} (versions only increase)")

    def _set_version(self, weight_version: int | None) -> None:
        self._check_version(weight_version)
        if weight_version is not None:
            self._version = weight_version

    async def update_weights_from_tensor(self, named_tensors: list,
                                         weight_version: int | None = None) -> None:
        """Copy `(hf_name, tensor)` pairs into the parameters; set the version when given
        (None keeps it: several buckets of one publication pass the version on any of them).
        Running requests are retracted so no KV of the old weights is reused."""
        named_tensors = list(named_tensors)
        self._check_names([n for n, _ in named_tensors], [list(t.shape) for _, t in named_tensors])
        async with self._guard():
            self._set_version(weight_version)
            with torch.no_grad():
                for name, tensor in named_tensors:
                    if self._params[name].data_ptr() != tensor.data_ptr():
                        self._params[name].copy_(tensor.to(self.device))
            self._weights_changed()
            self._retract_running()

    def _check_names(self, names: list[str], shapes: list[list[int]]) -> None:
        """Validate the whole bucket before copying anything, so a bad one changes nothing."""
        for name, shape in zip(names, shapes, strict=True):
            if name not in self._params:
                raise EngineError(f"weight update: parameter {name!r} is not in the engine's "
                                  f"model (e.g. {sorted(self._params)[:3]}); names must be "
                                  f"the HF names of the same architecture")
            if list(self._params[name].shape) != [int(d) for d in shape]:
                raise EngineError(f"weight update: {name!r} has shape {list(shape)}, the "
                                  f"engine's is {list(self._params[name].shape)}")
