"""Renderers: turn an AuditReport (or a post-mortem frame) into text. The only place with rich."""
