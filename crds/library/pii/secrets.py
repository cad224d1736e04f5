import math
import re

# Credentials recognised by the prefix their issuer gives them.
KNOWN = [
    ("openai-key", r"sk-(?:proj-|ant-)?[A-Za-z0-9_\-]{20,}"),
    ("github-token", r"(?:ghp|gho|ghu|ghs|ghr)_[A-Za-z0-9]{36}|github_pat_[A-Za-z0-9_]{22,}"),
    ("aws-access-key", r"(?:AKIA|ASIA)[0-9A-Z]{16}"),
    ("slack-token", r"xox[abprs]-[A-Za-z0-9\-]{10,}"),
    ("google-api-key", r"AIza[0-9A-Za-z_\-]{35}"),
    ("stripe-key", r"(?:sk|rk)_live_[0-9A-Za-z]{24,}"),
    ("jwt", r"eyJ[A-Za-z0-9_\-]{8,}\.eyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}"),
    ("private-key", r"-----BEGIN [A-Z ]*PRIVATE KEY-----[\s\S]*?-----END [A-Z ]*PRIVATE KEY-----"),
]
PATTERN = re.compile("|".join(f"(?P<k{i}>(?<![A-Za-z0-9_]){p})" for i, (_, p) in enumerate(KNOWN)))
TOKEN = re.compile(r"(?<![A-Za-z0-9+/=_\-])[A-Za-z0-9+/=_\-]{20,}(?![A-Za-z0-9+/=_\-])")


def entropy(token):
    """Shannon entropy of the token's characters, in bits per character."""
    n = len(token)
    return -sum(c / n * math.log2(c / n) for c in (token.count(x) for x in set(token)))


def find(text, settings):
    spans = [(m.start(), m.end(), KNOWN[int(m.lastgroup[1:])][0]) for m in PATTERN.finditer(text)]
    if _setting(settings, "entropy", True):
        least = int(_setting(settings, "min_length", 32))
        bits = float(_setting(settings, "min_entropy", 4.2))
        taken = [(s, e) for s, e, _ in spans]
        for m in TOKEN.finditer(text):
            token = m.group()
            if len(token) < least or any(s < m.end() and m.start() < e for s, e in taken):
                continue
            mixed = any(c.isdigit() for c in token) and any(c.isalpha() for c in token)
            if mixed and entropy(token) >= bits:
                spans.append((m.start(), m.end(), "secret"))
    return spans


def execute(context, settings):
    return _masked(context, settings, find)
