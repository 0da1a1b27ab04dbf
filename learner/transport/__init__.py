"""The sending side of weight updates, one sender per row of core.choices.TRANSPORT_TABLE."""
