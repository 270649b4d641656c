"""The operator console (docs/console.md): server-rendered pages under /_gateway/console for
the people who reconcile lost outcomes and watch leases.

It sits beside the API, one layer above it: every change it makes goes through the API's own
code (`gateway.api.receipts.resolve_receipt`, `gateway.api.leases.revoke`,
`gateway.upkeep.reconcile.probe`), so a decision made in a browser is checked, logged and
written on the receipt exactly as one made over HTTP. The server mounts it (`mount.mount`).
"""
