// A base source that includes a header of the train layer: the layer rule must refuse it.
#include "actmem/base/compat.h"
#include "actmem/train/trainer.h"
