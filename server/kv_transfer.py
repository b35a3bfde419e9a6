"""KV blocks over HTTP between a prefill and a decode instance that do not share a folder (other hosts).

The producer serves its finished requests' block files (`GET /v1/kv_blocks/{hash}`, the disk tier's checked
safetensors files: model identity, block size, dtype, shape, tokens and a CRC32 inside). A request sent to a
consumer with `"kv_transfer_params": {"source": URL}` (the proxy adds it when the two instances' folders differ)
first pulls the prompt's full blocks it does not have from that instance, several at once, checks each one
(identity, tokens, checksum) and adds it to its own disk tier; then the request runs and its prefix lookup finds
them. The pulls run on the server's event loop and a thread, beside the engine's steps for other requests. A
block that cannot be fetched or fails a check is skipped with a warning (the decode instance computes it).
"""

from __future__ import annotations

import asyncio
import logging
import re

import aiohttp
from aiohttp import web

from jaxpaged.core.block_pool import prompt_block_hashes
from server.protocol import APIError

logger = logging.getLogger(__name__)

MAX_PARALLEL = 8
_HASH = re.compile(r"[0-9a-f]{16}")


FOLDER_ID = ".folder-id"


def folder_id(folder: str) -> str:
    """A random id kept in the folder (made by the first instance to ask): two instances see the same id only
    when they see the same folder, whatever its path on each host."""
    import os
    import uuid

    path = os.path.join(folder, FOLDER_ID)
    os.makedirs(folder, exist_ok=True)
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.{uuid.uuid4().hex}"
        with open(tmp, "w") as f:
            f.write(uuid.uuid4().hex)
        try:
            os.link(tmp, path)  # (atomic, and never replaces another instance's id)
        except FileExistsError:
            pass
        finally:
            os.remove(tmp)
    with open(path) as f:
        return f.read().strip()


def _disk(state):
    """The engine's disk tier (the first replica's: every replica shares the folder), or None."""
    offload = state.engine.engine.core.offload
    return None if offload is None else offload.disk


async def serve_block(request: web.Request) -> web.StreamResponse:
    """`GET /v1/kv_blocks/{hash}`: one block file of this instance's disk tier (16 hex digits)."""
    from server.state import STATE

    disk = _disk(request.app[STATE])
    name = request.match_info["hash"]
    if disk is None or not disk.enabled:
        raise APIError("this server keeps no KV blocks (start it with --kv-role producer)", status=404,
                       err_type="NotFoundError")
    if not _HASH.fullmatch(name):
        raise APIError(f"not a block hash: {name!r}", param="hash")
    path = disk.path(int(name, 16))
    try:
        data = await asyncio.to_thread(_read, path)
    except FileNotFoundError:
        raise APIError(f"no block {name} here", status=404, err_type="NotFoundError") from None
    return web.Response(body=data, content_type="application/octet-stream")


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def prompt_blocks(token_ids: list[int], block_size: int, cache_salt: str | None = None
                  ) -> list[tuple[int, tuple[int, ...]]]:
    """(hash, tokens) of the prompt's full blocks that a prefix lookup may load (never the last token's), hashed
    as the engine hashes them (the salt in the first)."""
    bs = block_size
    blocks = [tuple(token_ids[i * bs : (i + 1) * bs]) for i in range((len(token_ids) - 1) // bs)]
    return list(zip(prompt_block_hashes(blocks, cache_salt), blocks))


def transfer_source(body: dict, state) -> str | None:
    """The prefill instance named in a request's `kv_transfer_params` to pull its blocks from, or None. Only a
    consumer reads the field (others ignore it, as vLLM does), and only a source it was told to trust
    (`jaxpaged serve --kv-pull-from`): anything else is a 400 naming the field."""
    params = body.get("kv_transfer_params")
    if params is None or state.engine.engine.config.cache_config.kv_role not in ("consumer", "both"):
        return None
    source = params.get("source") if isinstance(params, dict) else None
    if not isinstance(source, str):
        raise APIError("kv_transfer_params must be {\"source\": \"http://HOST:PORT\"} (the prefill instance)",
                       param="kv_transfer_params")
    source = source.rstrip("/")
    if source not in state.kv_pull_from:
        raise APIError(f"kv_transfer_params: this server does not pull KV blocks from {source} (it trusts "
                       f"{', '.join(state.kv_pull_from) or 'none'}: jaxpaged serve --kv-pull-from)",
                       param="kv_transfer_params")
    return source


async def pull_blocks(state, request: web.Request, source: str, prompts: list[list[int]],
                      cache_salt: str | None = None) -> int:
    """Fetch the prompts' full blocks this instance's folder lacks from `source`; returns how many were added."""
    disk = _disk(state)
    bs = state.engine.engine.config.cache_config.block_size
    wanted: dict[int, tuple[int, ...]] = {}
    for ids in prompts:
        for h, tokens in prompt_blocks(ids, bs, cache_salt):
            wanted.setdefault(h, tokens)
    missing = await asyncio.to_thread(lambda: [(h, t) for h, t in wanted.items() if not disk.has_file(h)])
    if not missing:
        return 0
    headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
    headers["Accept-Encoding"] = "identity"
    most = disk.block_bytes + (1 << 20)  # (a block file: the block, its tokens and a small header)
    limit = asyncio.Semaphore(MAX_PARALLEL)
    timeout = aiohttp.ClientTimeout(total=120, sock_connect=10)

    async def one(session, h: int, tokens: tuple[int, ...]) -> bool:
        async with limit:
            try:
                async with session.get(f"{source}/v1/kv_blocks/{h:016x}", headers=headers) as resp:
                    if resp.status != 200:
                        logger.warning("KV pull: %s answered %d for block %016x", source, resp.status, h)
                        return False
                    data = bytearray()
                    async for chunk in resp.content.iter_chunked(1 << 16):
                        data += chunk
                        if len(data) > most:
                            logger.warning("KV pull: block %016x from %s is larger than a block file", h, source)
                            return False
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                logger.warning("KV pull: block %016x from %s failed (%s)", h, source, e)
                return False
        return await asyncio.to_thread(disk.adopt, h, tokens, bytes(data))

    async with aiohttp.ClientSession(timeout=timeout) as session:
        added = await asyncio.gather(*(one(session, h, t) for h, t in missing))
    return sum(added)
