/* Eval and abort callbacks for llama.cpp contexts, compiled by workers/native.py.
 *
 * The capture callback copies the residual stream after a shard's last local layer
 * (the graph node named by `target`) into `dst` and, when `stop_after` is set, stops the graph
 * there so the output norm and the vocabulary head never run. ggml asks the callback about
 * every graph node on every step, so it must stay a few instructions per call: that is why it
 * is C and not a Python ctypes callback. It links against nothing: the ggml functions it needs
 * are passed in as pointers by the Python side.
 */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef const char *(*kvp_get_name_fn)(const void *tensor);
typedef size_t (*kvp_nbytes_fn)(const void *tensor);
typedef void (*kvp_tensor_get_fn)(const void *tensor, void *data, size_t offset, size_t size);

struct kvp_capture {
    kvp_get_name_fn get_name;
    kvp_nbytes_fn nbytes;
    kvp_tensor_get_fn tensor_get;
    char target[64];
    int32_t stop_after;
    int32_t overflow;       /* set when the captured tensor did not fit in dst */
    uint8_t *dst;           /* where the next capture is written */
    size_t dst_capacity;    /* bytes available at dst */
    size_t captured_bytes;  /* bytes written by the last capture */
    int64_t captures;       /* number of captures since the counter was reset */
};

bool kvp_eval_callback(void *tensor, bool ask, void *user_data) {
    struct kvp_capture *capture = (struct kvp_capture *)user_data;
    if (strcmp(capture->get_name(tensor), capture->target) != 0) {
        return !ask;
    }
    if (ask) {
        return true;
    }
    size_t nbytes = capture->nbytes(tensor);
    if (nbytes > capture->dst_capacity) {
        capture->overflow = 1;
        capture->captured_bytes = 0;
    } else {
        capture->tensor_get(tensor, capture->dst, 0, nbytes);
        capture->captured_bytes = nbytes;
    }
    capture->captures += 1;
    return !capture->stop_after;
}

/* data points at an int32 flag, possibly in shared memory written by another process. */
bool kvp_abort_callback(void *data) {
    return __atomic_load_n((const int32_t *)data, __ATOMIC_RELAXED) != 0;
}

size_t kvp_capture_struct_size(void) {
    return sizeof(struct kvp_capture);
}

/* llama.cpp log filter: llama-cpp-python's own callback maps ggml's log levels from an older enum
 * (it prints warnings as errors), so workers install this one. Levels: 1 debug .. 4 error, 5 continues. */
#include <stdio.h>

static int kvp_log_threshold = 4;
static int kvp_log_last_level = 0;

void kvp_set_log_threshold(int threshold) {
    kvp_log_threshold = threshold;
}

void kvp_log_callback(int level, const char *text, void *user_data) {
    (void)user_data;
    if (level != 5) {
        kvp_log_last_level = level;
    }
    if (kvp_log_last_level >= kvp_log_threshold) {
        fputs(text, stderr);
    }
}
