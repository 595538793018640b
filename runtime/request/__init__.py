"""A request as the runtime sees it, from the caller's arguments to the scheduler's queue.

``params.py`` holds SamplingParams (SGLang's field names, validated in ``__post_init__``),
``builder.py`` turns Engine.generate / ``/generate`` arguments into validated Reqs (n per prompt,
sizes checked before anything is built), ``req.py`` the central types (Req, FinishReason,
StepOutput) with the stage that fills each field, ``errors.py`` the typed RequestError that names
the field at fault, and ``healing.py`` token healing (the prompt's last token backed off and
regrown under a constraint).
"""
