"""The cluster MCP server takes numbers and booleans as written, through mcp.Client: a
``tp_size: true`` is not 1, ``"64"`` is not 64, ``8.0`` is not an integer, ``1`` is not true."""

from __future__ import annotations

import pytest
from fixtures.configs import config
from mcp import Client

from mcp_servers.cluster.server import build_server as cluster_server
from mcp_servers.cluster.twin import TwinBackend

pytestmark = pytest.mark.anyio

LAX_CONFIGS = {  # ServingConfig field -> a value pydantic's lax mode would coerce
    "tp-size-true": ("tp_size", True),
    "tp-size-str": ("tp_size", "8"),
    "tp-size-float": ("tp_size", 8.0),
    "replicas-true": ("replicas", True),
    "max-running-str": ("max_running_requests", "64"),
    "radix-int": ("disable_radix_cache", 1),
    "radix-str": ("disable_radix_cache", "true"),
    "hicache-ratio-bool": ("hicache_ratio", True),
    "mem-fraction-str": ("mem_fraction_static", "0.8"),
}


@pytest.mark.parametrize("case", sorted(LAX_CONFIGS))
async def test_deploy_refuses_a_config_of_lax_types(case):
    field, value = LAX_CONFIGS[case]
    backend = TwinBackend("strict")
    async with Client(cluster_server(backend)) as c:
        r = await c.call_tool("deploy", {"name": "lax", "config": config(**{field: value})})
        assert r.is_error, r.structured_content
        assert field in r.content[0].text
        assert backend.list() == []  # nothing was deployed


LAX_ARGS = {  # tool -> arguments with a scalar of the wrong type (lax mode would coerce it)
    "deploy-wait-bool": ("deploy", {"name": "x", "config": config(), "wait_s": True}, "wait_s"),
    "logs-tail-bool": ("get_logs", {"name": "ok", "tail": True}, "tail"),
    "logs-max-lines-str": ("get_logs", {"name": "ok", "max_lines": "5"}, "max_lines"),
    "logs-start-float": ("get_logs", {"name": "ok", "start": 1.0}, "start"),
    "logs-replica-bool": ("get_logs", {"name": "ok", "replica": False}, "replica"),
    "events-max-items-bool": ("get_events", {"max_items": True}, "max_items"),
    "events-since-str": ("get_events", {"since_s": "60"}, "since_s"),
}


@pytest.mark.parametrize("case", sorted(LAX_ARGS))
async def test_cluster_tools_refuse_scalars_of_lax_types(case):
    tool, args, field = LAX_ARGS[case]
    backend = TwinBackend("strict")
    async with Client(cluster_server(backend)) as c:
        ok = await c.call_tool("deploy", {"name": "ok", "config": config()})
        assert not ok.is_error, ok.content
        r = await c.call_tool(tool, args)
        assert r.is_error, r.structured_content
        assert field in r.content[0].text
        assert [d.name for d in backend.list()] == ["ok"]


async def test_whole_numbers_for_float_arguments_still_work():
    async with Client(cluster_server(TwinBackend("strict"))) as c:
        r = await c.call_tool("deploy", {"name": "ok", "config": config(hicache_ratio=2,
                                                                       enable_hierarchical_cache=True),
                                         "wait_s": 5})
        assert not r.is_error, r.content
        r = await c.call_tool("get_events", {"since_s": 60})
        assert not r.is_error, r.content
