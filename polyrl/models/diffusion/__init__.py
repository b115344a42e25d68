"""Diffusion models behind one velocity interface: `pipeline` (diffusers pipelines), `adapters` (one per family),
`tiny` (the quickstart's transformer and digit images)."""
