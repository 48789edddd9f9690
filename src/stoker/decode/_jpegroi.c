/*
 * Region-of-interest JPEG decode on libjpeg-turbo's libjpeg API (stoker's own binding).
 *
 * RandomResizedCrop keeps on average about half of an image (area scale uniform in
 * [0.08, 1]), yet a whole-image decode pays for every pixel.  libjpeg-turbo (>= 1.5) can
 * decode part of an image:
 *   - rows below the crop are never entropy-decoded (the decode stops at the crop's last row);
 *   - rows above it are entropy-decoded but not dequantised, IDCT'd, upsampled or colour
 *     converted (jpeg_skip_scanlines);
 *   - columns outside it (rounded out to iMCU boundaries) skip IDCT, upsampling and colour
 *     conversion (jpeg_crop_scanline).
 * The pixels produced are those of a whole-image decode with the same settings (accurate
 * integer IDCT, fancy upsampling: the settings Pillow and simplejpeg's accurate mode use);
 * the Python side checks that claim in its tests.
 *
 * Strictness: any libjpeg warning (corrupt data, premature end of data, ...) aborts the
 * decode with ValueError, as simplejpeg's strict=True does, so the caller can hand the file
 * to the reference decoder.  Errors never call exit(): the error manager longjmps back here.
 *
 * Functions (all release the GIL while libjpeg runs):
 *   header(data) -> (height, width, jpeg_color_space)
 *   structure_ok(data) -> bool (see structure_ok below)
 *   decode_region(data, top, left, height, width[, margin]) -> (bytearray, x0, out_width)
 *       bytearray holds `height` rows of `out_width` RGB pixels (uint8, row-major) starting at
 *       image column x0 <= left, with x0 + out_width >= left + width (iMCU alignment); the
 *       columns are first widened by `margin` on each side, within the image.  IndexError when
 *       the region is outside the image, ValueError on a libjpeg error/warning or CMYK/YCCK.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <setjmp.h>
#include <stdio.h>
#include <string.h>

#include <jpeglib.h>

typedef struct {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    char message[JMSG_LENGTH_MAX];
} strict_error_mgr;

static void strict_error_exit(j_common_ptr cinfo) {
    strict_error_mgr *err = (strict_error_mgr *)cinfo->err;
    (*cinfo->err->format_message)(cinfo, err->message);
    longjmp(err->jump, 1);
}

static void strict_emit_message(j_common_ptr cinfo, int msg_level) {
    if (msg_level < 0) { /* a warning: treated as an error (strict mode) */
        strict_error_mgr *err = (strict_error_mgr *)cinfo->err;
        (*cinfo->err->format_message)(cinfo, err->message);
        longjmp(err->jump, 1);
    }
    /* trace messages (msg_level >= 0) are ignored */
}

static void init_errors(struct jpeg_decompress_struct *cinfo, strict_error_mgr *err) {
    cinfo->err = jpeg_std_error(&err->pub);
    err->pub.error_exit = strict_error_exit;
    err->pub.emit_message = strict_emit_message;
    err->message[0] = '\0';
}

static PyObject *jpegroi_header(PyObject *self, PyObject *args) {
    Py_buffer buf;
    struct jpeg_decompress_struct cinfo;
    strict_error_mgr err;
    int ok = 0;
    JDIMENSION height = 0, width = 0;
    int space = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*", &buf)) return NULL;
    init_errors(&cinfo, &err);
    jpeg_create_decompress(&cinfo);
    Py_BEGIN_ALLOW_THREADS
    if (setjmp(err.jump) == 0) {
        jpeg_mem_src(&cinfo, (const unsigned char *)buf.buf, (unsigned long)buf.len);
        jpeg_read_header(&cinfo, TRUE);
        height = cinfo.image_height;
        width = cinfo.image_width;
        space = (int)cinfo.jpeg_color_space;
        ok = 1;
    }
    jpeg_destroy_decompress(&cinfo);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&buf);
    if (!ok) {
        PyErr_Format(PyExc_ValueError, "JPEG header: %s", err.message);
        return NULL;
    }
    return Py_BuildValue("(IIi)", (unsigned int)height, (unsigned int)width, space);
}

/*
 * Whether a region decode can stop early without hiding a structural error.  A single-scan
 * (sequential) JPEG is decoded row by row, so rows below a region are never read; an error
 * marker there (a second SOI or SOF, a stray marker inside the entropy-coded data) would make
 * the whole-image decode fail while a region above it decodes.  Returns 1 when that cannot
 * happen: the file has several scans (progressive, or the first scan holds fewer components
 * than the frame: libjpeg reads the whole file before the first row), or its one scan holds
 * only entropy-coded bytes, byte stuffing (FF 00), restart markers (FF D0-D7) and fill bytes
 * (FF FF) up to the final EOI.  Returns 0 otherwise (the caller decodes the whole image).
 */
static int structure_ok(const unsigned char *d, size_t n) {
    size_t pos = 2, scan = 0, end;
    int frame_components = -1, progressive = 0, scan_components = -1;
    if (n < 4 || d[0] != 0xFF || d[1] != 0xD8 || d[n - 2] != 0xFF || d[n - 1] != 0xD9) return 0;
    while (pos + 4 <= n) {
        unsigned int m, len;
        if (d[pos] != 0xFF) return 0;
        while (pos < n && d[pos] == 0xFF) pos++;
        if (pos + 3 > n) return 0;
        m = d[pos++];
        if (m == 0xD8 || m == 0xD9) return 0;
        if ((m >= 0xD0 && m <= 0xD7) || m == 0x01) continue;
        len = ((unsigned int)d[pos] << 8) | d[pos + 1];
        if (len < 2 || pos + len > n) return 0;
        if (m >= 0xC0 && m <= 0xCF && m != 0xC4 && m != 0xC8 && m != 0xCC) {
            if (len < 8) return 0;
            frame_components = d[pos + 7];
            progressive = (m == 0xC2 || m == 0xC6 || m == 0xCA || m == 0xCE);
        } else if (m == 0xDA) {
            if (len < 3) return 0;
            scan_components = d[pos + 2];
            scan = pos + len;
            break;
        }
        pos += len;
    }
    if (scan == 0 || frame_components < 1) return 0;
    if (progressive || scan_components < frame_components) return 1;
    end = n - 2;
    pos = scan;
    while (pos < end) {
        const unsigned char *ff = memchr(d + pos, 0xFF, end - pos);
        size_t q;
        if (ff == NULL) return 1;
        q = (size_t)(ff - d) + 1;
        while (q < end && d[q] == 0xFF) q++;
        if (q >= end) return 1;
        if (d[q] != 0x00 && (d[q] < 0xD0 || d[q] > 0xD7)) return 0;
        pos = q + 1;
    }
    return 1;
}

static PyObject *jpegroi_structure_ok(PyObject *self, PyObject *args) {
    Py_buffer buf;
    int ok;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*", &buf)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    ok = structure_ok((const unsigned char *)buf.buf, (size_t)buf.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&buf);
    return PyBool_FromLong(ok);
}

static PyObject *jpegroi_decode_region(PyObject *self, PyObject *args) {
    Py_buffer buf;
    unsigned int top, left, height, width, margin = 0;
    struct jpeg_decompress_struct cinfo;
    strict_error_mgr err;
    PyObject *volatile out = NULL;
    unsigned char *pixels;
    JDIMENSION x0 = 0, out_width = 0;
    volatile int stage = 0; /* 0 failed, 1 bad request, 2 ok */
    (void)self;
    if (!PyArg_ParseTuple(args, "y*IIII|I", &buf, &top, &left, &height, &width, &margin)) return NULL;
    if (height == 0 || width == 0) {
        PyBuffer_Release(&buf);
        PyErr_SetString(PyExc_ValueError, "empty region");
        return NULL;
    }
    /* The output buffer is sized after the header is read; allocate it with the GIL held. */
    init_errors(&cinfo, &err);
    jpeg_create_decompress(&cinfo);
    if (setjmp(err.jump) != 0) {
        jpeg_destroy_decompress(&cinfo);
        PyBuffer_Release(&buf);
        Py_XDECREF(out);
        PyErr_Format(PyExc_ValueError, "JPEG decode: %s", err.message);
        return NULL;
    }
    jpeg_mem_src(&cinfo, (const unsigned char *)buf.buf, (unsigned long)buf.len);
    jpeg_read_header(&cinfo, TRUE);
    if (top + height > cinfo.image_height || left + width > cinfo.image_width ||
        top + height < top || left + width < left) {
        unsigned int ih = cinfo.image_height, iw = cinfo.image_width;
        jpeg_destroy_decompress(&cinfo);
        PyBuffer_Release(&buf);
        PyErr_Format(PyExc_IndexError, "region %u,%u %ux%u outside the %ux%u image", top, left, height, width, ih, iw);
        return NULL;
    }
    if (cinfo.jpeg_color_space == JCS_CMYK || cinfo.jpeg_color_space == JCS_YCCK) {
        jpeg_destroy_decompress(&cinfo);
        PyBuffer_Release(&buf);
        PyErr_SetString(PyExc_ValueError, "CMYK/YCCK colour space");
        return NULL;
    }
    /* widen the columns by `margin` on each side, within the image */
    {
        unsigned int lo = left > margin ? left - margin : 0;
        unsigned int hi = left + width + margin;
        if (hi > cinfo.image_width || hi < left) hi = cinfo.image_width;
        left = lo;
        width = hi - lo;
    }
    cinfo.out_color_space = JCS_RGB;
    cinfo.dct_method = JDCT_ISLOW;
    cinfo.do_fancy_upsampling = TRUE;
    jpeg_start_decompress(&cinfo);
    x0 = left;
    out_width = width;
    if (left > 0 || width < cinfo.output_width) jpeg_crop_scanline(&cinfo, &x0, &out_width);
    if (cinfo.output_components != 3) {
        jpeg_destroy_decompress(&cinfo);
        PyBuffer_Release(&buf);
        PyErr_SetString(PyExc_ValueError, "decoder did not produce 3 components");
        return NULL;
    }
    out = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)height * out_width * 3);
    if (out == NULL) {
        jpeg_destroy_decompress(&cinfo);
        PyBuffer_Release(&buf);
        return NULL;
    }
    pixels = (unsigned char *)PyByteArray_AS_STRING(out);
    Py_BEGIN_ALLOW_THREADS
    if (setjmp(err.jump) == 0) {
        size_t stride = (size_t)out_width * 3;
        JDIMENSION end = top + height;
        if (top > 0) {
            JDIMENSION skipped = jpeg_skip_scanlines(&cinfo, top);
            if (skipped != top) longjmp(err.jump, 2);
        }
        while (cinfo.output_scanline < end) {
            JSAMPROW rows[16];
            JDIMENSION want = end - cinfo.output_scanline, i, got;
            if (want > 16) want = 16;
            for (i = 0; i < want; i++)
                rows[i] = pixels + (size_t)(cinfo.output_scanline - top + i) * stride;
            got = jpeg_read_scanlines(&cinfo, rows, want);
            if (got == 0) longjmp(err.jump, 2);
        }
        stage = 2;
    }
    Py_END_ALLOW_THREADS
    /* jpeg_abort: the rows below the region are never decoded. */
    jpeg_destroy_decompress(&cinfo);
    PyBuffer_Release(&buf);
    if (stage != 2) {
        Py_DECREF(out);
        PyErr_Format(PyExc_ValueError, "JPEG decode: %s", err.message[0] ? err.message : "short read");
        return NULL;
    }
    return Py_BuildValue("(NII)", out, (unsigned int)x0, (unsigned int)out_width);
}

static PyMethodDef jpegroi_methods[] = {
    {"header", jpegroi_header, METH_VARARGS,
     "header(data) -> (height, width, jpeg_color_space); ValueError on any libjpeg error or warning."},
    {"structure_ok", jpegroi_structure_ok, METH_VARARGS,
     "structure_ok(data) -> bool: a region decode that stops early cannot hide a structural error "
     "(several scans, or one scan of entropy-coded data, stuffing, RST and fill bytes up to the final EOI)."},
    {"decode_region", jpegroi_decode_region, METH_VARARGS,
     "decode_region(data, top, left, height, width[, margin]) -> (bytearray, x0, out_width): RGB rows "
     "[top, top+height) and columns [x0, x0+out_width) covering [left-margin, left+width+margin) within "
     "the image. IndexError for a region outside the image; ValueError on any libjpeg error or warning "
     "or CMYK/YCCK input."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef jpegroi_module = {
    PyModuleDef_HEAD_INIT, "_jpegroi",
    "Region-of-interest JPEG decode (libjpeg-turbo libjpeg API; jpeg_skip_scanlines, jpeg_crop_scanline).",
    -1, jpegroi_methods,
};

PyMODINIT_FUNC PyInit__jpegroi(void) { return PyModule_Create(&jpegroi_module); }
