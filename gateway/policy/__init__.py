"""Policy files: the typed schema, the loader, and resource globs."""

from gateway.policy.loader import PolicyError, load_policies
from gateway.policy.models import PolicySet, ResourceRule, Upstream

__all__ = ["PolicyError", "PolicySet", "ResourceRule", "Upstream", "load_policies"]
