"""A small MCP server for the tool-server tests (issue 45), written with the `mcp` SDK's server side (`MCPServer`,
mcp 2's name for FastMCP) and run over stdio: `python tests/mcp_test_server.py [NAME]` (NAME: the label it
reports, default `calc`); `... NAME --http PORT` or `... NAME --sse PORT` serve streamable HTTP (at /mcp) or SSE
(at /sse) on 127.0.0.1 instead.

Tools: `add(a, b)` (the sum), `boom(reason)` (always raises), `hang(reason)` (sleeps an hour: past any client's
timeout), `echo(text)` (annotated read-only). Their argument schemas admit no other keys, so a call forced by
constrained decoding writes just these arguments and ends."""

import asyncio
import logging
import sys
from typing import Annotated

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.tools import Tool
from mcp.types import ToolAnnotations
from pydantic import Field

Short = Annotated[str, Field(max_length=16)]


def add(a: int, b: int) -> int:
    "Add two integers."
    return a + b


def boom(reason: Short) -> str:
    "A tool that always fails."
    raise RuntimeError(f'boom: {reason}')


async def hang(reason: Short) -> str:
    "A tool that does not answer in time (it sleeps an hour)."
    await asyncio.sleep(3600)
    return reason


def echo(text: str) -> str:
    "Repeat the text."
    return text


def strict(fn, **kw) -> Tool:
    t = Tool.from_function(fn, **kw)
    t.parameters['additionalProperties'] = False
    return t


tools = [strict(add), strict(boom), strict(hang), strict(echo, annotations=ToolAnnotations(readOnlyHint=True))]
server = MCPServer(sys.argv[1] if len(sys.argv) > 1 else 'calc', instructions='Arithmetic and test tools', tools=tools)

if __name__ == '__main__':
    logging.disable(logging.ERROR)  # the SDK logs a raising tool's traceback to stderr: not wanted in test logs
    if len(sys.argv) > 3:
        kind = {'--http': 'streamable-http', '--sse': 'sse'}[sys.argv[2]]
        server.run(kind, host='127.0.0.1', port=int(sys.argv[3]))
    else:
        server.run()
