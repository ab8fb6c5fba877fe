"""Policy: the YAML schema, the pure evaluation, and the (hot-reloading) loader."""

from .evaluate import evaluate
from .loader import PolicyWatcher, load_policy, parse_policy
from .schema import POLICY_VERSION, Policy

__all__ = ["POLICY_VERSION", "Policy", "PolicyWatcher", "evaluate", "load_policy", "parse_policy"]
