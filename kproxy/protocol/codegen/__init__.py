"""Source generation from the schema, for ``kproxy.protocol.compiler``: text only, nothing is run here.

``layout`` says what the schema means for one message version on the wire (which fields are
present, tagged, nullable, compact; which structs a decoder meets; minimum sizes), in no language.
``python_source``, ``python_decoders`` and ``python_encoders`` write the Python codec from it;
``skip_program`` turns it into the table the C accelerator (``_accel.c``) interprets. A second
back end (C for hot messages) would read the same layout. No I/O, no imports outside kproxy.protocol.
"""
