"""llama-server's own endpoint on the simulated engine: `/slots`, one entry per parallel sequence slot."""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

if TYPE_CHECKING:
    from services.engines.simulated.app import EngineServer


def llama_server_routes(server: EngineServer) -> list[Route]:
    config = server.config

    async def slots(request: Request) -> Response:
        server.require_serving()
        busy = [g for g in server.driver.active.values() if g.sim_request is not None]
        per_slot_ctx = config.kv_tokens // config.max_num_seqs
        out = []
        for slot in range(config.max_num_seqs):
            gen = busy[slot] if slot < len(busy) else None
            out.append({
                "id": slot,
                "id_task": int(gen.request_id.rsplit("-", 1)[1]) if gen else -1,
                "n_ctx": per_slot_ctx,
                "is_processing": gen is not None,
                "n_prompt_tokens": gen.prompt_tokens if gen else 0,
                "n_decoded": gen.emitted if gen else 0,
                "simulated": True,
            })
        return JSONResponse(out)

    return [Route("/slots", slots, methods=["GET"])]
