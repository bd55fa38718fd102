"""Training the drafters this toolkit ships, and measuring them along the way.

The commands under ``scripts/`` are thin entry points (their options, then a call) into these modules:

* :mod:`.common`: what every trainer shares: the log line, ``--device``, atomic writes (through
  ``sharpdraft_theory.atomic``), AdamW with its warmup and cosine schedule, one optimiser step, the
  running mean of the logged numbers, and the progress file a stopped run resumes from;
* :mod:`.loss`: the one distillation loss (training and online adaptation, ``calibrate.online``);
* :mod:`.features`: target features for EAGLE-3 and DFlash training (``scripts/target_features.py``);
* :mod:`.eagle3`: the demo EAGLE-3 heads by EAGLE-3's training-time test, which is the head's own
  :meth:`~calibrate.drafters.eagle3.Eagle3Head.unrolled` (``scripts/train_demo_eagle3.py``);
* :mod:`.chain`: teacher-forced agreement at every step of a head's chain (``scripts/chain_agreement.py``);
* :mod:`.induction`: a copy circuit built into a head (``scripts/induction_head.py``);
* :mod:`.dflash`: a DFlash head (``scripts/train_dflash.py``) and :mod:`.draft_vocab`, its draft
  vocabulary (``scripts/dflash_draft_vocab.py``);
* :mod:`.pard`: a PARD drafter (``scripts/train_pard.py``), :mod:`.regenerate`, text the target
  writes for it (``scripts/regenerate.py``), and :mod:`.pard_cut`, which layers to cut
  (``scripts/pard_cut_agreement.py``);
* :mod:`.pointer`: a copy pointer's grid fit (``scripts/fit_copy_pointer.py``);
* :mod:`.gpu_stage`: SmolLM2 sent to a GPU machine in checked parts (``scripts/gpu_stage.py``).

Nothing is imported here: ``gpu_stage`` runs before torch or the package's dependencies are in place.
"""
