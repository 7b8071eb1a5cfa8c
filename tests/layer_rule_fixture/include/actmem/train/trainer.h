// Stands for the train layer's header in the layer rule's negative test.
#pragma once
