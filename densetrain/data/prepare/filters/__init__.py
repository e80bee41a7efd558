"""The quality filters run on each cleaned document: the interface (:mod:`.base`), the word, sentence
and punctuation units they count in (:mod:`.text`), Gopher quality and repetition (:mod:`.gopher`),
C4 (:mod:`.c4`), FineWeb's line rules (:mod:`.fineweb`), and the chain that cleans text, builds a
source's filters from its config and counts their verdicts (:mod:`.chain`). Called per document by
the preparation workers (:mod:`densetrain.data.prepare.process`) and the datatrove filter step.
"""
