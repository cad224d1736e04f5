import re

# Phrasings of prompt injection and jailbreak attempts, each a signal; a payload with at least
# `threshold` distinct signals is an attempt.
SIGNALS = {
    "ignore-instructions": r"\b(?:ignore|disregard|forget|skip|override)\b[\w\s,]{0,30}?\b(?:previous|prior|above|earlier|preceding|all|your|the|system)\b[\w\s]{0,20}?\b(?:instructions?|prompts?|rules|directions|guidelines|context)\b",
    "new-instructions": r"\b(?:new|updated|real|actual)\s+(?:instructions?|system\s+prompt|rules)\s*[:\-]",
    "role-override": r"\byou\s+are\s+(?:now|no\s+longer)\b|\bfrom\s+now\s+on,?\s+you\b|\bact\s+as\s+(?:an?\s+)?(?:unrestricted|unfiltered|jailbroken|evil|DAN)\b|\bpretend\s+(?:that\s+)?you\s+(?:are|have)\s+no\b",
    "reveal-prompt": r"\b(?:reveal|show|print|repeat|output|tell\s+me|what\s+(?:is|are))\b[\w\s]{0,20}?\b(?:system\s+prompt|hidden\s+instructions|initial\s+instructions|your\s+instructions|developer\s+message)\b",
    "jailbreak": r"\b(?:jailbreak|DAN\s+mode|developer\s+mode|do\s+anything\s+now|god\s+mode)\b",
    "chat-markup": r"<\|(?:im_start|im_end|system|endoftext)\|>|\[/?INST\]|<<SYS>>|^\s*#{2,}\s*(?:system|instruction)s?\s*:?\s*$",
    "safety-off": r"\b(?:without|no|disable|bypass|turn\s+off)\b[\w\s]{0,15}?\b(?:restrictions|filters?|safety|guardrails|censorship|content\s+policy)\b",
}
COMPILED = {name: re.compile(p, re.IGNORECASE | re.MULTILINE) for name, p in SIGNALS.items()}


def execute(context, settings):
    threshold = int(_setting(settings, "threshold", 1))
    patterns = dict(COMPILED)
    for i, extra in enumerate(_setting(settings, "extra_patterns", [])):
        patterns[f"extra-{i + 1}"] = re.compile(extra, re.IGNORECASE | re.MULTILINE)
    texts = []
    _walk(context["outgoing"], lambda t: texts.append(t) or t)
    found = sorted(name for name, p in patterns.items() if any(p.search(t) for t in texts))
    if len(found) < threshold:
        return {"action": "pass"}
    message = _setting(settings, "message", "The message was blocked: it reads as an attempt to override the assistant's instructions.")
    return _answer(context["outgoing"], {"signals": found}, message)
