"""`quiesce serve`: the ledger as a service — HTTP API v1 over the embedded `Coordinator`.

One file per concern:

- `service` — the lifecycle (standby → recovering → ready → stopping) and the one operation at a
  time every mutating request runs as; operations run in the service's own task group, so a client
  that disconnects never cancels one half-way.
- `app` — the FastAPI routes of API v1, `/metrics`, `/healthz`, `/readyz` and the live page.
- `unified` — the routes of Gym's unified plane only (`/v1/retire`, `/v1/forget`), an `APIRouter`.
- `models` — the pydantic request and reply models of API v1 (the OpenAPI schema is built from them).
- `auth` — the API bearer token (`QUIESCE_API_TOKEN`), compared in constant time.
- `guard` — what every request passes before a route: its `Host`, its `Origin`, JSON for a state
  change, a body of at most 1 MiB.
- `hosts` — the names the service answers to (`QUIESCE_ALLOW_HOSTS`) and the origin it trusts.
- `stream` — the live ledger tail behind the server-sent event streams.
- `metrics` — the Prometheus metrics, folded from the events the coordinator commits.
- `page` — the live page at `/`.
- `docs` — `/docs` (Swagger UI) with its assets served here, for clusters without internet access.
- `validation` — a request that does not validate, as the service's error reply (422).
- `runner` — uvicorn on a bound socket, SIGTERM handling, the `--listen` rules.
- `client` — `RemoteCoordinator`, the same shapes as `Coordinator` over HTTP.
- `errors` — the errors only the service and its client raise (busy, unauthorized, unavailable).

Layering: `quiesce.tools.serve` imports `coordinator` and `ledger` (read APIs only); nothing imports it back.
"""
