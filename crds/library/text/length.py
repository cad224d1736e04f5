def execute(context, settings):
    limit = int(settings["max_chars"])
    total = 0

    def count(text):
        nonlocal total
        total += len(text)
        return text

    _walk(context["outgoing"], count)
    if total <= limit:
        return {"action": "pass"}
    findings = {"chars": total, "max_chars": limit}
    suffix = _setting(settings, "suffix", "…")
    left = limit

    def cut(text):
        nonlocal left
        if len(text) <= left:
            left -= len(text)
            return text
        kept = text[: max(left - len(suffix), 0)] + suffix[:left] if left else ""
        left = 0
        return kept

    outgoing = _walk(context["outgoing"], cut) if DECLARED_ACTION == "modify" else None
    message = _setting(settings, "message", "The message was not sent: it is {chars} characters long, over the {max_chars} allowed.")
    return _answer(outgoing, findings, message.replace("{chars}", str(total)).replace("{max_chars}", str(limit)))
