"""``app.client_images`` by value: what the Python client sends for each kind of image a user may hold (paths, bytes,
file objects, PIL images of every mode, numpy arrays of every dtype), and the refusals, by message. No server: the
round trips through the API are ``test_app_client.py``'s."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from app.client_images import encode_image, files_fields

JPEG = b"\xff\xd8\xff\xe0" + b"\0" * 8
WEBP = b"RIFF\0\0\0\0WEBPVP8 "


def png_of(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


def sent(image) -> Image.Image:  # noqa: ANN001
    """The image the client uploads for ``image``, decoded."""
    name, data, content_type = encode_image(image)
    assert content_type == "image/png" and name == "image0.png"
    return Image.open(io.BytesIO(data))


def test_bytes_go_as_they_are_named_and_typed_by_their_content():
    png = png_of(Image.new("L", (3, 2)))
    assert encode_image(png, 4) == ("image4.png", png, "image/png")
    assert encode_image(JPEG, 1) == ("image1.jpg", JPEG, "image/jpeg")
    assert encode_image(bytearray(WEBP)) == ("image0.webp", WEBP, "image/webp")
    assert encode_image(memoryview(JPEG)) == ("image0.jpg", JPEG, "image/jpeg")
    assert encode_image(b"RIFF\0\0\0\0WAVE")[2] == "image/png"  # not an image: sent, and the API names the problem
    assert encode_image(b"\xff\xd8")[2] == "image/png"  # too short for a JPEG


def test_paths_pairs_and_file_objects_keep_their_names(tmp_path):
    path = tmp_path / "cat.jpeg"
    path.write_bytes(JPEG)
    assert encode_image(path) == ("cat.jpeg", JPEG, "image/jpeg")
    assert encode_image(str(path), 7) == ("cat.jpeg", JPEG, "image/jpeg")
    assert encode_image(("dog.webp", WEBP)) == ("dog.webp", WEBP, "image/webp")
    assert encode_image(("dog.bin", io.BytesIO(JPEG))) == ("dog.bin", JPEG, "image/jpeg")
    with open(path, "rb") as f:
        assert encode_image(f) == ("cat.jpeg", JPEG, "image/jpeg")
    assert encode_image(io.BytesIO(WEBP), 3) == ("image3.png", WEBP, "image/webp")  # no name: a default one


def test_what_is_no_image_is_refused_by_name():
    with pytest.raises(TypeError, match="cannot send int as an image: give a path, bytes, a PIL image or an array"):
        encode_image(3)
    with pytest.raises(TypeError, match="cannot send dict"):
        encode_image({"a": 1})


def test_arrays_of_each_shape():
    gray = np.arange(12, dtype=np.uint8).reshape(3, 4) * 20
    assert np.array_equal(np.asarray(sent(gray)), gray) and sent(gray).mode == "L"
    assert np.array_equal(np.asarray(sent(gray[:, :, None])), gray)  # HxWx1: gray
    rgb = np.stack([gray, gray // 2, 255 - gray], axis=2)
    assert sent(rgb).mode == "RGB" and np.array_equal(np.asarray(sent(rgb)), rgb)
    rgba = np.dstack([rgb, np.full((3, 4), 7, np.uint8)])
    assert sent(rgba).mode == "RGBA" and np.array_equal(np.asarray(sent(rgba)), rgba)
    assert np.array_equal(np.asarray(sent(gray.tolist())), gray)  # a nested list: an array
    for shape in [(12,), (3, 4, 2), (3, 4, 5), (2, 3, 4, 3)]:
        with pytest.raises(ValueError, match=rf"HxW or HxWx\{{1,3,4\}}; got shape \({shape[0]},"):
            encode_image(np.zeros(shape, np.uint8))


def test_float_arrays_are_read_on_0_1_else_0_255():
    ramp = np.linspace(0.0, 1.0, 6).reshape(2, 3)
    assert np.asarray(sent(ramp)).tolist() == [[0, 51, 102], [153, 204, 255]]  # x 255, rounded
    assert np.asarray(sent(ramp * 100)).tolist() == [[0, 20, 40], [60, 80, 100]]  # max above 1: as 0..255
    assert np.asarray(sent(np.array([[1.0, 0.5]]))).tolist() == [[255, 128]]  # 1.0 itself is the [0, 1] scale
    assert np.asarray(sent(np.array([[1.5, 254.6]], np.float32))).tolist() == [[2, 255]]
    assert np.asarray(sent(np.array([[0.0, 255.0]]))).tolist() == [[0, 255]]  # the bounds are in
    assert np.asarray(sent(np.array([[0.0, 2.0]]))).tolist() == [[0, 2]]  # above 1: not scaled
    for bad, message in ((np.array([[-0.01, 0.5]]), "from -0.01 to 0.5"), (np.array([[0.0, 255.5]]), "to 255.5"),
                         (np.array([[np.inf, 0.0]]), "^an image array holds NaN or infinite values$"),
                         (np.array([[0.0, -np.inf]]), "infinite")):
        with pytest.raises(ValueError, match=message):
            encode_image(bad)


def test_integer_arrays_are_read_on_0_255_and_uint16_on_16_bits():
    assert np.asarray(sent(np.array([[0, 7, 255]], np.int64))).tolist() == [[0, 7, 255]]
    assert sent(np.array([[0, 7, 255]], np.int64)).mode == "L"
    assert np.asarray(sent(np.array([[0, 1]], np.int32))).tolist() == [[0, 1]]  # integers are never scaled
    for bad, message in ((np.array([[0, 256]]), "^an integer image array .* from 0 to 256"),
                         (np.array([[-1, 3]], np.int16), "from -1 to 3")):
        with pytest.raises(ValueError, match=message):
            encode_image(bad)
    sixteen = np.array([[0, 257, 65535]], np.uint16)
    assert sent(sixteen).mode == "I;16" and np.asarray(sent(sixteen)).tolist() == [[0, 257, 65535]]
    rgb16 = np.dstack([np.array([[0, 257, 1000, 65535]], np.uint16)] * 3)
    assert np.asarray(sent(rgb16))[0, :, 0].tolist() == [0, 1, 4, 255]  # colour: its 8 bits here, v / 257


def test_a_boolean_mask_goes_up_black_and_white():
    mask = np.zeros((4, 6), bool)
    mask[1:3, 2:4] = True
    one_bit = sent(mask)
    assert one_bit.mode == "1" and np.array_equal(np.asarray(one_bit), mask)  # as PIL sends its own mask
    assert png_of(Image.fromarray(mask)) == encode_image(Image.fromarray(mask))[1]
    colour = sent(np.dstack([mask] * 3))
    assert colour.mode == "RGB" and np.asarray(colour)[..., 0].tolist() == (mask * 255).tolist()


def test_pil_images_keep_the_modes_png_holds_and_convert_the_others():
    rgb = Image.fromarray(np.arange(24, dtype=np.uint8).reshape(2, 4, 3) * 10)
    for mode in ("1", "L", "LA", "P", "RGB", "RGBA"):
        assert sent(rgb.convert(mode)).mode == mode
    assert sent(rgb.convert("P").convert("PA")).mode == "RGBA"  # PNG holds no PA
    for mode in ("CMYK", "YCbCr", "HSV"):
        assert sent(rgb.convert(mode)).mode == "RGB", mode
    # 16 bits in another byte order: their values (PIL's own convert to I;16 clipped them at 255: white)
    big_endian = Image.fromarray(np.array([[1, 2, 600]], dtype=">u2"))
    assert big_endian.mode == "I;16B" and sent(big_endian).mode == "I;16"
    assert np.asarray(sent(big_endian)).tolist() == [[1, 2, 600]]
    for mode in ("I;16L", "I;16N"):
        other = Image.new(mode, (3, 1))
        other.putpixel((2, 0), 60000)
        assert other.mode == mode and sent(other).mode == "I;16"
        assert np.asarray(sent(other)).tolist() == [[0, 0, 60000]], mode


def test_wide_pil_modes_by_the_array_rules():
    assert sent(Image.fromarray(np.array([[0, 255]], np.int32))).mode == "L"  # within 8 bits
    assert np.asarray(sent(Image.fromarray(np.array([[0, 256]], np.int32)))).tolist() == [[0, 256]]  # 16 bits
    with pytest.raises(ValueError, match="from 0 to 65536"):
        encode_image(Image.fromarray(np.array([[0, 65536]], np.int32)))
    as16 = sent(Image.fromarray(np.array([[0, 256, 65535]], np.int32)))
    assert as16.mode == "I;16" and np.asarray(as16).tolist() == [[0, 256, 65535]]
    with pytest.raises(ValueError, match="mode I is read as 8 bits .* got values from -1 to 0"):
        encode_image(Image.fromarray(np.array([[-1, 0]], np.int32)))
    assert np.asarray(sent(Image.fromarray(np.array([[0.0, 1.0]], np.float32)))).tolist() == [[0, 255]]
    with pytest.raises(ValueError, match="from 0 to 300"):
        encode_image(Image.fromarray(np.array([[0.0, 300.0]], np.float32)))


def test_a_pil_image_goes_up_upright():
    stored = Image.new("L", (4, 2), 0)
    stored.putpixel((0, 0), 255)
    exif = Image.Exif()
    exif[0x0112] = 6  # shown rotated 90 degrees clockwise
    buf = io.BytesIO()
    stored.save(buf, "PNG", exif=exif)
    upright = sent(Image.open(io.BytesIO(buf.getvalue())))
    assert upright.size == (2, 4) and upright.getpixel((1, 0)) == 255


def test_files_fields_take_one_image_or_a_list():
    png = png_of(Image.new("L", (3, 2)))
    assert files_fields(png) == [("files", ("image0.png", png, "image/png"))]
    assert files_fields([png, JPEG], "negative_files") == [("negative_files", ("image0.png", png, "image/png")),
                                                           ("negative_files", ("image1.jpg", JPEG, "image/jpeg"))]
    assert [f[1][0] for f in files_fields((png, png))] == ["image0.png", "image1.png"]  # a tuple of images
    assert files_fields(("a.png", png)) == [("files", ("a.png", png, "image/png"))]  # a (name, bytes) pair: one
    assert len(files_fields(np.zeros((3, 4), np.uint8))) == 1  # an array is one image
    with pytest.raises(ValueError, match="^at least one image is needed$"):
        files_fields([])
