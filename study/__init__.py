# The fast paths every committed result under study/results/ was made with: train.py's defaults until
# issue #49 made the plain step the default. Each study passes them to train.py, so the command it
# records reproduces its committed numbers (the plain step samples the same tokens and rewards; its
# losses and KLs differ in the last bits, which a 100-step run can carry into other samples).
RECORDED_FAST_PATHS = ["--sampler", "kv", "--pack", "true", "--share-prompts", "true"]
