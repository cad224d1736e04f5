import re


def compiled(settings):
    flags = 0 if _setting(settings, "case_sensitive", False) else re.IGNORECASE
    edge = r"\b" if _setting(settings, "whole_words", True) else ""
    parts = [(w, f"{edge}{re.escape(w)}{edge}") for w in _setting(settings, "words", [])]
    parts += [(p, p) for p in _setting(settings, "patterns", [])]
    return [(label, re.compile(p, flags)) for label, p in parts]


def execute(context, settings):
    rules = compiled(settings)
    matched = []
    mask = _setting(settings, "mask", "[removed]")

    def scan(text):
        for label, pattern in rules:
            text, n = pattern.subn(mask, text)
            if n and label not in matched:
                matched.append(label)
        return text

    outgoing = _walk(context["outgoing"], scan)
    if not matched:
        return {"action": "pass"}
    message = _setting(settings, "message", "The message was blocked: it mentions a topic this assistant does not discuss.")
    return _answer(outgoing, {"matched": matched}, message)
