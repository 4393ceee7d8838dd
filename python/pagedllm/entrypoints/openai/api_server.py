"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) over an AsyncLLM.

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with SSE streaming),
GET /v1/models, GET /health, GET /metrics (Prometheus text), POST /tokenize, POST /detokenize,
GET /version, GET /tokenizer_info (--enable-tokenizer-info-endpoint), and FastAPI's /openapi.json,
/docs, /redoc. With an API key every route but /health
needs ``Authorization: Bearer <key>`` (compared in constant time, ``secrets.compare_digest``);
/metrics too unless --metrics-public (Prometheus scrapers without the key).

    pagedllm serve [MODEL] --host 127.0.0.1 --port 8000 [--api-key KEY] [--served-model-name NAME]
                   [--metrics-public] [--max-queued-requests N] [every LLM engine argument as --flag]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import secrets
from contextlib import asynccontextmanager
from typing import Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.chat_templates import load_chat_template
from pagedllm.entrypoints.openai.errors import OpenAIError, error_response, install_handlers
from pagedllm.entrypoints.openai.lifecycle import GracefulServer, InFlight
from pagedllm.entrypoints.openai.limits import RequestSizeLimit, default_max_request_bytes
from pagedllm.entrypoints.openai.metrics import make_registry
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest, ChatCompletionResponse, CompletionRequest, CompletionResponse, DetokenizeRequest,
    DetokenizeResponse, ErrorResponse, ModelCard, ModelList, TokenizeRequest, TokenizeResponse, TokenizerInfoResponse,
)
from pagedllm.entrypoints.openai.rate_limit import RateLimiter
from pagedllm.entrypoints.openai.serving import ServingContext, check_model
from pagedllm.entrypoints.openai.serving_chat import ChatHandler, conversation
from pagedllm.entrypoints.openai.serving_completion import CompletionHandler
from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS
from pagedllm.metrics import PREFIX, Counter

logger = logging.getLogger("pagedllm")

_ERROR = {"model": ErrorResponse}
#: the errors every route may answer (with an API key: 401; over --max-request-bytes: 413; over a
#: rate limit: 429; queue full or shutting down: 503)
_ERRORS = {400: _ERROR, 401: _ERROR, 404: _ERROR, 413: _ERROR, 429: _ERROR, 503: _ERROR}


def _generation_responses(model) -> dict:
    """OpenAPI responses of a generation route: the JSON body, or with stream=true server-sent
    events (each `data:` line one chunk of the same shape, then `data: [DONE]`), and the errors."""
    return {200: {"model": model, "content": {"text/event-stream": {"schema": {
        "type": "string", "description": "stream=true: `data: <chunk JSON>` lines, then `data: [DONE]`"}}}},
        **_ERRORS}


def build_app(engine: AsyncLLM, served_model_names: Optional[list[str]] = None,
              api_key: Optional[Union[str, list[str]]] = None,
              max_queued_requests: Optional[int] = None, shutdown_engine: bool = False,
              metrics_public: bool = False, force_include_usage: bool = False,
              tokenizer_info: bool = False, root_path: str = "", metrics_prefix: str = "pagedllm",
              max_request_bytes: Optional[int] = None, max_logprobs: int = 20,
              rate_limit_rpm: Optional[int] = None, rate_limit_tpm: Optional[int] = None,
              chat_template: Optional[str] = None, enable_auto_tool_choice: bool = False,
              tool_call_parser: Optional[str] = None, structured_outputs_config: Optional[dict] = None) -> FastAPI:
    """The FastAPI app serving `engine`. served_model_names: names accepted in "model" (the first
    is reported); default the engine's model name. api_key: required on every route but /health
    (and /metrics with metrics_public). shutdown_engine: shut the engine down when the app stops.
    force_include_usage: every stream ends with a usage chunk. tokenizer_info: serve
    /tokenizer_info. root_path: the path prefix a proxy serves the app under (OpenAPI links).
    metrics_prefix: /metrics names' prefix ("vllm": vLLM's names, for its dashboards).
    max_request_bytes: the largest request body (413 above; default_max_request_bytes of the
    context length when None). max_logprobs: most logprobs per token a request may ask for (-1:
    no limit, logprobs -1 = the whole vocabulary allowed). api_key may be several keys (each
    request names one); rate_limit_rpm / rate_limit_tpm: requests / tokens per minute per key
    (rate_limit.py). chat_template: a file, Jinja text or a bundled template's name, used when a
    request names none. enable_auto_tool_choice + tool_call_parser ("hermes" | "llama3_json"):
    tool_choice "auto" reads calls out of the output. structured_outputs_config:
    {"disable_any_whitespace": bool}, the requests' default. Errors: ValueError naming the bad one."""
    names = list(served_model_names or [engine.model_name])
    if max_queued_requests is not None and max_queued_requests < 0:
        raise ValueError(f"max_queued_requests must be >= 0, got {max_queued_requests}")
    engine.set_model_name(names[0])  # the metrics' model_name label, as vLLM's
    if max_logprobs < -1:
        raise ValueError(f"max_logprobs must be >= -1 (-1: no limit), got {max_logprobs}")
    if tool_call_parser is not None and tool_call_parser not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser {tool_call_parser!r} is not one of {', '.join(sorted(TOOL_PARSERS))}")
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError("enable_auto_tool_choice needs a tool_call_parser (hermes | llama3_json)")
    ctx = ServingContext(engine, names, max_queued_requests, force_include_usage, max_logprobs,
                         RateLimiter(rate_limit_rpm, rate_limit_tpm),
                         chat_template=load_chat_template(chat_template) if chat_template is not None else None,
                         enable_auto_tool_choice=enable_auto_tool_choice, tool_call_parser=tool_call_parser,
                         structured_outputs_defaults=dict(structured_outputs_config or {}))
    completions = CompletionHandler(ctx)
    chat = ChatHandler(ctx)

    def all_metrics():  # the engine's and the server's own (rate-limited requests)
        labels = {"model_name": names[0]}
        return engine.get_metrics() + [Counter(PREFIX + "rate_limited_requests", {**labels, "limit": k}, v)
                                       for k, v in ctx.rate_limiter.refused.items()]

    registry = make_registry(all_metrics, metrics_prefix)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        if shutdown_engine:
            engine.shutdown()

    app = FastAPI(title="pagedllm OpenAI-compatible server", lifespan=lifespan, root_path=root_path)
    app.state.ctx = ctx
    install_handlers(app)
    app.add_middleware(RequestSizeLimit, max_bytes=max_request_bytes or default_max_request_bytes(ctx.max_model_len))

    if api_key:
        keys = [k.encode() for k in ([api_key] if isinstance(api_key, str) else api_key)]
        open_paths = {"/health"} | ({"/metrics"} if metrics_public else set())

        @app.middleware("http")
        async def _auth(request: Request, call_next):
            if request.method != "OPTIONS" and request.url.path not in open_paths:
                header = request.headers.get("authorization", "")
                given = header[7:].encode() if header.lower().startswith("bearer ") else b""
                if not any([secrets.compare_digest(given, k) for k in keys]):  # every key compared: constant time
                    return error_response("Unauthorized: a missing or wrong API key (Authorization: Bearer ...)",
                                          401, None)
            return await call_next(request)

    @app.get("/health", response_class=Response, responses={
        200: {"description": "the engine is running (empty body)", "content": {}},
        503: {"description": "the engine is not running, or the server is shutting down", **_ERROR}})
    async def health() -> Response:
        if not getattr(engine, "is_healthy", engine.is_running):  # (data parallel: every replica)
            return error_response("the engine is not running" if not engine.is_running
                                  else "a data-parallel replica is not running", 503)
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        import pagedllm

        return {"version": pagedllm.__version__}

    @app.get("/metrics", response_class=Response, responses={200: {
        "description": "Prometheus text exposition (docs/serving.md lists the series)",
        "content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}}, 401: _ERROR})
    async def metrics() -> Response:
        await engine.refresh_metrics()  # an engine shared by several API servers: its current figures
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=ModelList)
    async def models():
        return ModelList(data=[ModelCard(id=n, root=str(engine.model_path), max_model_len=ctx.max_model_len)
                               for n in names])

    @app.post("/v1/completions", response_model=CompletionResponse, responses=_generation_responses(CompletionResponse))
    async def create_completion(request: CompletionRequest, raw_request: Request):
        return await completions(request, raw_request)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses=_generation_responses(ChatCompletionResponse))
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request):
        return await chat(request, raw_request)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize(request: TokenizeRequest):
        check_model(ctx, request.model)
        if (request.prompt is None) == (request.messages is None):
            raise OpenAIError("give exactly one of prompt or messages", 400, "prompt")
        if request.prompt is not None:
            ids = ctx.tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens is not False)
        else:
            req = ChatCompletionRequest(messages=request.messages, add_generation_prompt=request.add_generation_prompt,
                                        continue_final_message=request.continue_final_message)
            tools = [t.model_dump(exclude_none=True) for t in request.tools] if request.tools else None
            ids = chat.prompt_ids(req, conversation(request.messages), tools)
        strs = ctx.tokenizer.convert_ids_to_tokens(list(ids)) if request.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=ctx.max_model_len, tokens=list(ids), token_strs=strs)

    if tokenizer_info:
        @app.get("/tokenizer_info", response_model=TokenizerInfoResponse)
        async def get_tokenizer_info():
            tok = ctx.tokenizer
            info = {**getattr(tok, "init_kwargs", {}), "tokenizer_class": type(tok).__name__,
                    "model_max_length": ctx.max_model_len, "vocab_size": len(tok),
                    "chat_template": getattr(tok, "chat_template", None),
                    **{name: getattr(tok, name, None) for name in ("bos_token", "eos_token", "pad_token", "unk_token")}}
            # the JSON-plain settings (init_kwargs also hold objects such as AddedToken)
            return TokenizerInfoResponse(**{k: v for k, v in info.items()
                                            if v is None or isinstance(v, (str, int, float, bool))})

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(request: DetokenizeRequest):
        check_model(ctx, request.model)
        vocab = engine.model_config.vocab_size
        bad = [t for t in request.tokens if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(f"tokens: token id {bad[0]} is outside the vocabulary [0, {vocab})", 400, "tokens")
        return DetokenizeResponse(prompt=ctx.tokenizer.decode(request.tokens))

    limits = {"max_model_len": ctx.max_model_len, "max_num_seqs": engine.engine_args.max_num_seqs,
              "max_logprobs": max_logprobs, "vocab_size": engine.model_config.vocab_size}

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = openapi_with_limits(FastAPI.openapi(app), **limits)
        return app.openapi_schema

    app.openapi = openapi
    return app


def openapi_with_limits(schema: dict, max_model_len: int, max_num_seqs: int, max_logprobs: int,
                        vocab_size: int) -> dict:
    """The OpenAPI document with this deployment's limits on the request fields (the static
    ranges come from protocol.py): what the server refuses with a 400, the schema disallows."""
    components = schema.get("components", {}).get("schemas", {})
    for name, model in (("CompletionRequest", CompletionRequest), ("ChatCompletionRequest", ChatCompletionRequest)):
        props = components.get(name, {}).get("properties", {})
        # FastAPI's OpenAPI models hold bounds as floats (2**64 - 1 becomes 2**64): the exact ones
        for field, exact in model.model_json_schema()["properties"].items():
            for key in ("minimum", "exclusiveMinimum", "maximum"):
                if key in exact and field in props:
                    props[field][key] = exact[key]
        for field in ("max_tokens", "max_completion_tokens"):
            if field in props:
                props[field]["maximum"] = max_model_len - 1  # a prompt has at least one token
        if "n" in props:
            props["n"]["maximum"] = max_num_seqs
        for field in ("logprobs", "top_logprobs", "prompt_logprobs"):
            prop = props.get(field)
            if prop is None or not any(t.get("type") == "integer" for t in prop.get("anyOf", [prop])):
                continue
            if max_logprobs == -1:
                prop["minimum"], prop["maximum"] = -1, vocab_size
            else:
                prop["minimum"], prop["maximum"] = 0, max_logprobs
        for field in ("stop_token_ids", "allowed_token_ids", "prompt"):
            _bound_token_ids(props.get(field), vocab_size)
    return schema


def _bound_token_ids(prop, vocab_size: int) -> None:
    """Token ids anywhere in a property's schema (list[int], list[list[int]]): [0, vocab_size)."""
    if isinstance(prop, dict):
        if prop.get("type") == "integer":
            prop["minimum"], prop["maximum"] = 0, vocab_size - 1
        for value in prop.values():
            if isinstance(value, (dict, list)):
                _bound_token_ids(value, vocab_size)
    elif isinstance(prop, list):
        for item in prop:
            _bound_token_ids(item, vocab_size)


# ---------------------------------------------------------------------------- CLI
def _structured_outputs_config(text: str) -> dict:
    """--structured-outputs-config: JSON with backend (xgrammar, the one pagedllm has; "auto" means
    it) and disable_any_whitespace (the default of requests that do not set it)."""
    try:
        cfg = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(cfg, dict) or set(cfg) - {"backend", "disable_any_whitespace"}:
        raise argparse.ArgumentTypeError(f"give an object with backend and/or disable_any_whitespace, got {text!r}")
    if cfg.get("backend", "xgrammar") not in ("xgrammar", "auto"):
        raise argparse.ArgumentTypeError(f"backend {cfg['backend']!r}: pagedllm's grammar engine is xgrammar")
    if not isinstance(cfg.get("disable_any_whitespace", False), bool):
        raise argparse.ArgumentTypeError("disable_any_whitespace must be true or false")
    return {k: v for k, v in cfg.items() if k == "disable_any_whitespace"}


def add_server_args(parser: argparse.ArgumentParser) -> None:
    from pagedllm.entrypoints.openai.cli_args import add_engine_args

    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="model: a Hugging Face folder, a .gguf file, or a hub id in the local cache "
                             "(default: the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback; "
                        "0.0.0.0 exposes the server to the network)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", nargs="+", default=None, help="require 'Authorization: Bearer KEY' on every "
                        "route but /health (several keys: any of them; rate limits count per key)")
    parser.add_argument("--rate-limit-rpm", type=int, default=None,
                        help="requests per minute per API key (per client address without keys): 429 + Retry-After above")
    parser.add_argument("--rate-limit-tpm", type=int, default=None,
                        help="tokens (prompt + max_tokens) per minute per API key: 429 + Retry-After above")
    parser.add_argument("--metrics-public", action="store_true",
                        help="with --api-key, leave /metrics open (for Prometheus scrapers without the key)")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="model name(s) accepted in requests; the first is reported (default: MODEL)")
    parser.add_argument("--enable-force-include-usage", action="store_true",
                        help="every streamed response ends with a usage chunk, whatever stream_options says")
    parser.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                        help="serve GET /tokenizer_info (the tokenizer's configuration and chat template)")
    parser.add_argument("--root-path", default="", help="the path prefix a proxy serves the server under")
    parser.add_argument("--max-request-bytes", type=int, default=None,
                        help="refuse request bodies above this many bytes with a 413, before parsing (default: "
                             "1 MiB or 64 bytes per context token, whichever is larger)")
    parser.add_argument("--max-logprobs", type=int, default=20,
                        help="most logprobs per token a request may ask for (vLLM's default 20; -1: no limit, "
                             "and logprobs -1 returns the whole vocabulary)")
    parser.add_argument("--metrics-prefix", default="pagedllm",
                        help="prefix of the /metrics names (default pagedllm; 'vllm' serves vLLM's names, so vLLM's "
                             "Grafana dashboards and alerts work unchanged)")
    parser.add_argument("--max-queued-requests", type=int, default=None,
                        help="answer 503 (Retry-After) when this many requests already wait")
    parser.add_argument("--threads", type=int, default=0,
                        help="CPU threads for torch and the kernels (0: leave as is)")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="on SIGTERM / SIGINT: refuse new requests (503) and let those in flight finish for up to "
                             "this many seconds, then abort them (a second signal exits at once)")
    parser.add_argument("--api-server-count", "-asc", type=int, default=1,
                        help="HTTP front-end processes sharing the port and one engine process (vLLM's flag): more "
                             "than 1 when one process's event loop cannot keep up with many concurrent streams")
    parser.add_argument("--chat-template", default=None,
                        help="chat template of requests that name none: a file, Jinja text, or a bundled template "
                             "(hermes_tools: ChatML with tools, for --tool-call-parser hermes)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='tool_choice "auto" (the default with tools): the --tool-call-parser reads the model\'s '
                             "calls out of its output")
    parser.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                        help="how the model writes tool calls (hermes: <tool_call> blocks; llama3_json: Llama 3.1 JSON)")
    parser.add_argument("--structured-outputs-config", type=_structured_outputs_config, default={},
                        help='JSON defaults of structured outputs, vLLM\'s: {"backend": "xgrammar", '
                             '"disable_any_whitespace": true}')
    parser.add_argument("--uvicorn-log-level", default="warning",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    add_engine_args(parser)


def run_server(args: argparse.Namespace) -> int:
    """`pagedllm serve`: the engine (its own process by default) and one HTTP front end in this
    process, or with --api-server-count N > 1 the engine process and N front-end processes that
    share the listening socket (this process supervises them)."""
    from pagedllm.entrypoints.openai.cli_args import engine_args_from

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.threads > 0:
        from pagedllm import ops

        ops.set_cpu_threads(args.threads)
    engine_args = engine_args_from(args)
    if args.model_tag is not None:
        engine_args.model = args.model_tag
    if args.shutdown_timeout < 0:
        raise SystemExit(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")
    if args.api_server_count < 1:
        raise SystemExit(f"--api-server-count must be >= 1, got {args.api_server_count}")
    if args.api_server_count > 1:
        if args.rate_limit_rpm is not None or args.rate_limit_tpm is not None:
            raise SystemExit("--rate-limit-rpm / --rate-limit-tpm count in one process: use them with "
                             f"--api-server-count 1, not {args.api_server_count}")
        if engine_args.data_parallel_size != 1:
            raise SystemExit(f"--data-parallel-size {engine_args.data_parallel_size} needs --api-server-count 1 "
                             f"(one front end balances the replicas), got {args.api_server_count}")
        from pagedllm.entrypoints.openai.api_server_group import run_api_servers

        return run_api_servers(args, engine_args)
    if engine_args.data_parallel_size != 1:
        from pagedllm.engine.data_parallel import DPAsyncLLM

        try:
            engine = DPAsyncLLM.from_engine_args(engine_args)
        except ValueError as exc:  # a misconfiguration, before any replica starts
            raise SystemExit(str(exc)) from None
        return serve(args, engine)
    return serve(args, AsyncLLM.from_engine_args(engine_args))


def serve(args: argparse.Namespace, engine: AsyncLLM, sockets=None, early_signals: Optional[list] = None) -> int:
    """Serve `engine` over HTTP until a signal (GracefulServer's drain) or its death; returns the
    exit status (1 if the engine died). sockets: already bound listening sockets (several API
    server processes share one), else bind args.host / args.port. early_signals: signals caught
    before the server existed (it starts draining at once)."""
    import uvicorn

    app = build_app(engine, args.served_model_name, args.api_key, args.max_queued_requests, shutdown_engine=True,
                    metrics_public=args.metrics_public, force_include_usage=args.enable_force_include_usage,
                    tokenizer_info=args.enable_tokenizer_info_endpoint, root_path=args.root_path,
                    metrics_prefix=args.metrics_prefix, max_request_bytes=args.max_request_bytes,
                    max_logprobs=args.max_logprobs, rate_limit_rpm=args.rate_limit_rpm,
                    rate_limit_tpm=args.rate_limit_tpm, chat_template=args.chat_template,
                    enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
                    structured_outputs_config=args.structured_outputs_config)
    in_flight = InFlight(app)  # outermost: counts every request, 503s new ones while draining
    # loop="auto": uvloop when installed (a [serve] dependency on Linux, as vLLM's), else asyncio's
    config = uvicorn.Config(in_flight, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                            timeout_graceful_shutdown=5, loop="auto")
    server = GracefulServer(config, engine, in_flight, args.shutdown_timeout)
    if early_signals:
        server.handle_exit(early_signals[0], None)
    logger.info("serving %s on http://%s:%d", app.state.ctx.model_name, args.host, args.port)
    try:
        with asyncio.Runner(loop_factory=config.get_loop_factory()) as runner:
            runner.run(server.serve(sockets=sockets))
    finally:
        engine.shutdown()
    return server.exit_code


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedllm serve", description="OpenAI-compatible server")
    add_server_args(parser)
    return run_server(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
