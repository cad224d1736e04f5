# A ready hook of the Sluice library, used by name (`uses:`) from a HookChain. The chain's declared
# action decides what a match does: modify masks it, block blocks the payload, detect reports it.
# What the hook reports never holds the matched text: counts and kinds only.


def _walk(value, fn):
    """`fn(text)` applied to every string of `value` (nested lists and mappings; keys left alone),
    in order; returns the new value."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, list):
        return [_walk(v, fn) for v in value]
    if isinstance(value, dict):
        return {k: _walk(v, fn) for k, v in value.items()}
    return value


def _setting(settings, name, default):
    value = settings.get(name, default)
    return default if value is None else value


def _masked(context, settings, find):
    """The answer of a finder hook: `find(text, settings)` gives (start, end, kind) spans of a text."""
    counts = {}
    mask = _setting(settings, "mask", "[{kind}]")

    def replace(text):
        spans = sorted(find(text, settings))
        if not spans:
            return text
        out, at = [], 0
        for start, end, kind in spans:
            if start < at:
                continue
            counts[kind] = counts.get(kind, 0) + 1
            out.append(text[at:start])
            out.append(mask.replace("{kind}", kind))
            at = end
        out.append(text[at:])
        return "".join(out)

    outgoing = _walk(context["outgoing"], replace)
    if not counts:
        return {"action": "pass"}
    what = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
    message = _setting(settings, "message", "The message was not sent: it contains {what}.")
    return _answer(outgoing, {"found": counts}, message.replace("{what}", what))


def _answer(outgoing, findings, message):
    """What a ready hook answers when it found something: its declared action, with the payload
    (modify) or the message (block) that action needs."""
    answer = {"action": DECLARED_ACTION, "findings": findings}
    if DECLARED_ACTION == "modify":
        answer["outgoing"] = outgoing
    if DECLARED_ACTION == "block":
        answer["message"] = message
    return answer
